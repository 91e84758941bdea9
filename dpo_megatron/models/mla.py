"""Multi-latent attention (DeepSeek-V2 / V3) on this engine's rows: megatron-core's
``MLASelfAttention`` rotating with the model's per-row RoPE table, and packed rows handed to the
local core attention only.

megatron-core's MLA builds its own RoPE table for positions 0..L-1 of every row and refuses a
``rotary_pos_emb`` argument. This engine's rows restart positions at every packed sequence, so
the model (``models.gpt.ScoringGPTModel``) passes the table of each row's positions, [L, R, 1, rope
dims], as for every other architecture; :class:`DPOMLASelfAttention` gives it to megatron-core's
query/key computation in place of its own table (:class:`GivenRotary`). megatron-core applies it
with its MLA rule: the rotated dimensions are de-interleaved first (``x[0::2]`` then
``x[1::2]``), exactly HF DeepSeek-V3's ``rope_interleave=True``.

At TP > 1 the key/value down projection is column-parallel here (the local spec) and megatron-core
keeps one TP rank's share of the shared RoPE key's gradient; the layer names that projection's
output to ``compat.mla_rope_key_grad``, which sums the RoPE columns' gradient over TP.

Packed rows reach the core attention as ``packed_seq_params`` (``models.attention``); the
query/key/value computation does not need them (megatron-core only reads THD boundaries there,
and would squeeze a one-row batch), so it gets None.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from dpo_megatron.compat import mla_rope_key_grad


class GivenRotary(torch.nn.Module):
    """Stands in for MLA's rotary module: answers with the table the layer was given for this
    forward (``table``: [L, R, 1, dim]) instead of computing positions 0..L-1; with YaRN as
    megatron-core's ``YarnRotaryEmbedding`` does, together with its cos / sin scale
    (``mscale``)."""

    def __init__(self, mscale: float | None = None):
        super().__init__()
        self.table: torch.Tensor | None = None
        self.mscale = mscale

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.table.shape[0]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False):
        return self.table if self.mscale is None else (self.table, self.mscale)


class DPOMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` taking the per-row RoPE table as ``rotary_pos_emb``
    (module docstring). Shapes as the parent: hidden_states [s(/TP), b, h] -> ([s(/TP), b, h],
    bias).

    With YaRN (``rope_type='yarn'``) the table is the model's YaRN table and the cos / sin scale
    is that of megatron-core's own YaRN module of this layer (same config).

    Raises:
        ValueError: in forward without a RoPE table, or with transformer-engine's THD rows.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        mscale = None
        if config.rope_type == "yarn":
            _, mscale = self.rotary_pos_emb.get_emb(1)
        self.rotary_pos_emb = GivenRotary(mscale)
        if (
            isinstance(self.linear_kv_down_proj, ColumnParallelLinear)
            and self.pg_collection.tp.size() > 1
        ):  # its gathered RoPE key needs its gradient summed over TP (compat.mla_rope_key_grad)
            self.linear_kv_down_proj.register_forward_hook(self._name_rope_key_source)

    def _name_rope_key_source(self, module, args, output) -> None:
        mla_rope_key_grad.mark_rope_key_source(output[0], self.config.qk_pos_emb_head_dim)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if not isinstance(rotary_pos_emb, torch.Tensor):
            raise ValueError(
                "DPOMLASelfAttention needs the per-row RoPE table as rotary_pos_emb "
                "(models.gpt.ScoringGPTModel builds it)"
            )
        self.rotary_pos_emb.table = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self.rotary_pos_emb.table = None

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, position_ids=None, packed_seq_params=None, **kw
    ):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            raise ValueError(
                "multi-latent attention takes packed rows on the local spec only (not THD)"
            )
        return super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, None, **kw
        )
