"""Context-parallel core attention of the local layer spec (CPU/gloo, and GPUs without
transformer-engine; with transformer-engine megatron-core's ``TEDotProductAttention`` does CP
itself on the same load-balanced batch split).

Each CP rank holds L / CP tokens of every row (``data.context_split``: chunks r and 2CP-1-r of
every span). Per layer, keys and values are all-gathered over the CP group
(``parallel.context.gather_along_sequence``; its backward reduce-scatters their gradients back to
the ranks that hold the tokens), so every rank's queries attend to the whole row. Which key a
query may see is decided from token coordinates, not from their place in the row: key s is
visible to query t iff both belong to the same sequence (``segment_ids``) and
``position_ids[s] <= position_ids[t]`` (positions count from 0 inside each sequence, so this is
the causal rule of the unsplit row, whatever order the chunks were gathered in). The mask is
built once per forward (:func:`context_parallel_attention_mask`, coordinates all-gathered once)
and shared by every layer.

Cost: the all-gathered keys/values are [L, b, groups, hn] per layer (transient), the mask
[R or 1, 1, L / CP, L] bool per forward; the [b, heads, L / CP, L] scores are SDPA's business.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.dot_product_attention import DotProductAttention

from dpo_megatron.parallel.context import gather_along_sequence


@torch.no_grad()
def context_parallel_attention_mask(position_ids: torch.Tensor,
                                    segment_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """The attention mask of this CP rank's queries over the all-gathered keys (True = visible,
    SDPA's boolean convention).

    Args:
        position_ids: [R, L / CP] positions of this rank's tokens (inside their sequence).
        segment_ids: [R, L / CP] sequence ids of packed rows, or None (one sequence per row).

    Returns:
        [R, 1, L / CP, L] bool (R = 1 for padded rows whose positions are the same in every
        row), keys in the order :func:`gather_along_sequence` lays them out.
    """
    rows = position_ids
    if segment_ids is None and bool((position_ids == position_ids[:1]).all()):
        rows = position_ids[:1]  # padded rows: one mask broadcast over the rows
    key_pos = gather_along_sequence(rows.t().contiguous()).t()  # [R, L]
    visible = key_pos[:, None, :] <= rows[:, :, None]
    if segment_ids is not None:
        key_seg = gather_along_sequence(segment_ids.t().contiguous()).t()
        visible &= key_seg[:, None, :] == segment_ids[:, :, None]
    return visible.unsqueeze(1)


class ContextParallelAttention(DotProductAttention):
    """Core attention over keys/values all-gathered across the CP group (see the module doc).

    Same inputs and output as megatron-core's ``DotProductAttention`` (query [sq, b, np, hn], key
    / value [sq, b, ng, hn] with sq = L / CP -> context [sq, b, np * hn]); ``attention_mask`` is
    :func:`context_parallel_attention_mask`'s (True = visible), built by ``DPOGPTModel``.
    Computed by ``torch.nn.functional.scaled_dot_product_attention``. No attention dropout (the
    engine's dropout is 0), no softmax offsets or sliding windows.
    """

    def __init__(self, config, *args, **kwargs):
        # megatron-core's local attention refuses CP (its own CP is transformer-engine's); this
        # class does the CP part, so the parent is built for the per-rank computation.
        super().__init__(replace(config, context_parallel_size=1), *args, **kwargs)
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("context-parallel local attention takes neither an "
                                      "attention bias nor packed_seq_params")
        key, value = gather_along_sequence(key), gather_along_sequence(value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             scale=self.softmax_scale, enable_gqa=gqa)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def uses_context_parallel_attention(model: torch.nn.Module) -> bool:
    """True when ``model``'s layers attend with :class:`ContextParallelAttention` (so the model
    must build its mask); False for transformer-engine layers, which do CP themselves."""
    cached = getattr(model, "_uses_context_parallel_attention", None)
    if cached is None:
        cached = any(isinstance(m, ContextParallelAttention) for m in model.modules())
        model._uses_context_parallel_attention = cached
    return cached
