"""megatron-core ``GPTModel`` chunks for the supported architectures, with the two inputs a DPO
step needs beyond megatron-core's own forward.

The policy and the frozen reference are built by the same function, so they are sharded
identically: each pipeline rank holds its layers of both.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from dpo_megatron.models.attention import packed_format, packed_seq_params
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.context_attention import (
    context_parallel_coordinates,
    uses_context_parallel_attention,
)
from dpo_megatron.models.kv_cache import KVCache
from dpo_megatron.models.layers import LayerTypeRope
from dpo_megatron.models.logprobs import (
    HeadLogps,
    vocab_parallel_linear_logps,
    vocab_parallel_log_sum_p2,
    vocab_parallel_token_logps,
)
from dpo_megatron.models.moe import set_aux_loss_weight
from dpo_megatron.models.reward_head import attach_reward_head, reward_head
from dpo_megatron.models.specs import layer_spec
from dpo_megatron.models.transformer_config import build_transformer_config, padded_vocab_size
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.parallel.device import get_device, is_cuda, is_host
from dpo_megatron.utils.saved_activations import recompute_marked


class ScoringGPTModel(GPTModel):
    """``GPTModel`` whose forward also takes what a DPO micro-batch carries
    (``dpo_megatron.data.batch.MicroBatch``):

    * ``position_ids`` rotate RoPE row by row. megatron-core's forward applies RoPE at positions
      0..L-1 of every row and reads ``position_ids`` only for learned embeddings; packed rows
      restart positions at every sequence, so here RoPE uses the per-row table
      ``emb[position_ids]`` [L, R, 1, dim], which megatron-core's RoPE application broadcasts
      against [L, R, heads, dim] exactly like its own [L, 1, 1, dim] (same frequencies, element
      for element, as the padded path).
    * ``packed`` (packed rows): the micro-batch's ``PackedLayout`` (``data.batch``) goes to every
      layer's core attention as megatron-core's ``packed_seq_params``
      (``models.attention.PackedSequenceParams``: THD with transformer-engine, the local
      kernels' rows otherwise), which builds its own mask, block mask or varlen spans from it;
      None means one causal sequence per row. Nothing goes through ``attention_mask``, which
      stays None (megatron-core's recompute saves tensor arguments only). Under context
      parallelism with the local spec, rows are this CP rank's L / CP tokens
      (``data.context_split``; ``packed`` is then its ``LocalRows``) and ``attention_mask`` is
      the coordinates of its queries and of the all-gathered keys
      (``models.context_attention``), a tensor argument that recompute saves like the hidden
      states.
    * ``padding_mask`` [R, L] bool (True = padding, megatron-core's convention) keeps padding
      tokens out of MoE routers' load-balancing loss; ``moe_aux_loss_weight`` is what the step's
      gradient division counts this micro-batch as (its pairs: ``dpo_megatron.models.moe``).
      Both only matter for mixture-of-experts models.
    * ``output_index`` [n]: on the last stage only these flat positions (``r * L + t``) of the
      [R, L] input are projected onto the vocabulary. DPO scores completion tokens only, so prompt
      and padding hidden states never meet the LM head and no [R * L, V/TP] logits tensor is
      built for them (the idea of TRL's fused LM head). A position may be listed twice (a
      shared prompt's last token scores both completions). Under sequence parallelism the
      hidden states are all-gathered along the sequence first and the output layer runs without
      its own gather (as megatron-core's GPTModel does when it keeps only the last token's
      logits).

    * ``kv_cache`` (generation, ``models.kv_cache.KVCache``): the tokens are the next slots of
      the cache's rows, which every layer's core attention extends and attends to; positions
      may then exceed the row length (RoPE reads a table of ``kv_cache.capacity`` positions).

    * ``target_ids`` [n] (with ``output_index``): the last stage returns the log-probs of these
      targets instead of logits, through ``models.logprobs.vocab_parallel_linear_logps``,
      which never holds the [n, V/TP] logits (``log_sum_p2=True`` adds the WPO normaliser).

    * A reward model (``model.head=reward``) has no LM head: its ``reward_head``
      (``models.reward_head``) maps the final hidden state at each ``output_index`` position
      (one per sequence, its last token) to a scalar.

    The layers' norm outputs and SwiGLU products are not kept for backward but made again from
    what is (``utils.saved_activations``: bit-identical, a quarter less activation memory).

    Outputs: hidden states [L(/TP), R, h] off the last stage; on it, for a reward model the [n]
    fp32 rewards at ``output_index``; else with ``target_ids`` a ``HeadLogps`` of [n] fp32
    tensors, else vocab-parallel logits [1, n, V/TP] with ``output_index`` (in that order),
    else [R, L, V/TP].
    """

    thd = False
    """True when the layers are transformer-engine's: packed rows then go in THD form."""

    fused_lm_head = True
    """``model.fused_lm_head``: with ``target_ids``, the chunked log-prob head, else the output
    layer's logits reduced to log-probs (``build_model_chunks``)."""

    embedding_scale: float | None = None
    """``model.embedding_scale``: the word embeddings are multiplied by it (Gemma)."""

    vocab_valid_columns: int | None = None
    """Columns of this TP rank's vocabulary shard that hold real tokens (None: all); the rest
    is padding (``build_model_chunks``)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        packed=None,
        output_index: torch.Tensor | None = None,
        target_ids: torch.Tensor | None = None,
        log_sum_p2: bool = False,
        padding_mask: torch.Tensor | None = None,
        moe_aux_loss_weight: float = 1.0,
        kv_cache: KVCache | None = None,
    ):
        if kv_cache is not None:
            # Generation: the layers' core attention keeps and reads the keys (models.kv_cache).
            params = kv_cache
        elif self.config.context_parallel_size > 1 and uses_context_parallel_attention(self):
            # This CP rank's tokens (data.context_split): query and gathered key coordinates.
            params = None
            attention_mask = context_parallel_coordinates(
                position_ids,
                getattr(packed, "segment_ids", None),
                getattr(packed, "branch_ids", None),
            )
        else:
            params = None if packed is None else packed_seq_params(packed, thd=self.thd)
        decoder_input = (
            self.embedding(input_ids=input_ids, position_ids=position_ids)
            if self.pre_process
            else None
        )  # later stages: set_input_tensor
        if decoder_input is not None and self.embedding_scale is not None:
            # Gemma: the scale rounded to the model dtype first, as transformers does.
            decoder_input = decoder_input * torch.tensor(
                self.embedding_scale, dtype=decoder_input.dtype, device=decoder_input.device
            )
        if self.config.num_moe_experts:
            set_aux_loss_weight(self, moe_aux_loss_weight)
            padding_mask = self._local_padding_mask(padding_mask)
        else:
            padding_mask = None
        with recompute_marked():  # norm outputs, SwiGLU products: remade in backward
            hidden_states = self.decoder(
                hidden_states=decoder_input,
                attention_mask=attention_mask,
                rotary_pos_emb=self._rotary_per_row(
                    position_ids, None if kv_cache is None else kv_cache.capacity
                ),
                padding_mask=padding_mask,
                packed_seq_params=params,
            )
        if not self.post_process:
            return hidden_states
        head = reward_head(self)
        if head is not None:
            return head(self._scored_hidden(hidden_states, output_index))
        if output_index is None:
            logits, _ = self.output_layer(hidden_states, weight=self._output_weight())
            return logits.transpose(0, 1).contiguous()  # [L, R, V/TP] -> [R, L, V/TP]
        picked = self._scored_hidden(hidden_states, output_index)
        if target_ids is not None and self.fused_lm_head:
            weight = self._output_weight()
            return vocab_parallel_linear_logps(
                copy_to_tensor_model_parallel_region(picked),
                self.output_layer.weight if weight is None else weight,
                target_ids,
                self.vocab_valid_columns,
                log_sum_p2=log_sum_p2,
            )
        # [1, n, h]: the n positions as one "sequence" of batch n, so the logits come out as
        # [1, n, V/TP] with plain strides. (A transposed [n, 1, V/TP] gives a gradient whose
        # strides send megatron-core's frozen-weight backward, taken when the output layer is
        # frozen as under LoRA, into a slow batched matmul: many times the time on the CPU.)
        sequence_parallel = self.output_layer.sequence_parallel
        self.output_layer.sequence_parallel = False  # gathered by _scored_hidden
        try:
            logits, _ = self.output_layer(picked.unsqueeze(0), weight=self._output_weight())
        finally:
            self.output_layer.sequence_parallel = sequence_parallel
        if target_ids is not None:  # model.fused_lm_head=false: the logits stay for backward
            # squeeze, not logits[0]: a view's backward is a view, where select's would zero a
            # new [1, n, V/TP] gradient and copy into it
            logits = logits.squeeze(0)
            return HeadLogps(
                # only these log-probs read the logits: their gradient takes their memory
                vocab_parallel_token_logps(logits, target_ids, consume_logits=True),
                vocab_parallel_log_sum_p2(logits) if log_sum_p2 else None,
            )
        return logits  # [1, n, V/TP]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron-core's, for a reward model without the LM head its language-model layer
        expects (``LanguageModule.sharded_state_dict`` marks ``output_layer.weight``): the
        modules' own sharded tensors, the reward head replicated."""
        if reward_head(self) is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _local_padding_mask(self, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """[R, L] -> this TP rank's [R, L/TP] slice under sequence parallelism (the routers see
        only their slice of the sequence), on every pipeline stage."""
        if padding_mask is None or not self.config.sequence_parallel:
            return padding_mask
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        return padding_mask.chunk(tp, dim=1)[rank].contiguous()

    def _rotary_per_row(
        self, position_ids: torch.Tensor, bound: int | None = None
    ) -> torch.Tensor | None:
        """[L, R, 1, dim] RoPE table of each row's positions, or None without RoPE.

        Every position of a row is below its length L (padded, packed and shared-prompt rows
        alike), so the table of L positions is read without looking at device values; a
        generation forward gives the bound itself (``bound``: the cache's slots). In THD
        form (R = 1) it is megatron-core's per-token table ([T, 1, 1, dim] with T the packed
        tokens), which its THD RoPE applies token by token."""
        if self.position_embedding_type != "rope":
            return None
        # Under CP a row holds L / CP of the L positions (data.context_split).
        length = bound or position_ids.shape[-1] * self.config.context_parallel_size
        tables = []
        # With model.local_rotary_base the sliding-window layers have their own RoPE, the
        # submodule local_rotary_pos_emb (build_model_chunks), and every layer gets both
        # tables (models.layers.LayerTypeRope). Not a class attribute: it would shadow the
        # registered submodule.
        local = getattr(self, "local_rotary_pos_emb", None)
        for rope in (self.rotary_pos_emb, local):
            if rope is not None:
                table = rope.get_emb(length)
                if isinstance(table, tuple):  # YaRN: (table, cos / sin scale); the scale is
                    # MLA's (models.mla) or in the softmax scale (transformer_config)
                    table = table[0]
                table = table[:, 0, 0, :]  # [L, dim]
                tables.append(table[position_ids.to(table.device)].transpose(0, 1).unsqueeze(2))
        return tables[0] if len(tables) == 1 else LayerTypeRope(*tables)

    def _output_weight(self) -> torch.Tensor | None:
        """The LM head's weight when tied to the word embeddings, else None (the output layer's
        own)."""
        return (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )

    def _scored_hidden(
        self, hidden_states: torch.Tensor, output_index: torch.Tensor
    ) -> torch.Tensor:
        """[L(/TP), R, h] final hidden states -> [n, h] at the flat positions ``output_index``
        (``r * L + t``), all-gathered along the sequence first under sequence parallelism."""
        if self.config.sequence_parallel:
            # The LM head's input copy all-reduces the input gradient over TP, and the reward
            # head's is whole on every TP rank already, so the gather's backward only splits
            # (tensor_parallel_output_grad=False).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        length, rows, hidden = hidden_states.shape
        picked = hidden_states.transpose(0, 1).reshape(rows * length, hidden)
        return picked.index_select(0, output_index)


def lm_head_is_fused(setting: bool | None) -> bool:
    """``model.fused_lm_head`` resolved: an explicit true/false is kept; null (auto) is fused on
    an accelerator and unfused on the host CPU. On the CPU the second LM-head matmul that the
    fused head runs in backward costs more than keeping the [n, V] logits saves (measured:
    docs/BENCHMARKS.md); on a GPU the memory of the logits is the scarcer."""
    if setting is not None:
        return bool(setting)
    return not is_host()


def build_model_chunks(model: ModelConfig, parallel: ParallelConfig) -> list[ScoringGPTModel]:
    """This rank's model chunks (one, or one per virtual pipeline stage), randomly initialised,
    every parameter and buffer on the engine's device (``dpo_megatron.parallel.device``) in the
    model dtype (:func:`place_chunk`).

    Requires megatron-core's parallel state (``dpo_megatron.parallel.initialize_distributed``).
    Outputs of each chunk's forward on the last stage are vocab-parallel logits
    (``ScoringGPTModel``; fp32 on CPU, the model dtype on GPU), or with ``model.head=reward``
    rewards (the LM head replaced by ``models.reward_head``; embeddings never tied to it).
    """
    from dpo_megatron.compat import frozen_linear_fold, rope_tables_once

    reward = model.head == "reward"
    config = build_transformer_config(model, parallel)
    frozen_linear_fold.enable()  # a frozen reference's linears round as the policy's
    rope_tables_once.enable()  # one RoPE cos / sin per forward, not per layer
    if model.num_experts:
        _enable_moe_patches(model)
    if model.kv_lora_rank is not None:
        from dpo_megatron.compat import mla_rope_key_grad, mla_without_te

        mla_without_te.enable()
        mla_rope_key_grad.enable()
    if model.recompute_granularity == "selective" and not _have_transformer_engine():
        from dpo_megatron.compat import checkpoint_without_output_without_te

        checkpoint_without_output_without_te.enable()
    vocab = padded_vocab_size(
        model.vocab_size, model.make_vocab_size_divisible_by, parallel.tensor_model_parallel_size
    )
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = ScoringGPTModel(
            config=config,
            transformer_layer_spec=layer_spec(model, config, stage),
            vocab_size=vocab,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings and not reward,
            position_embedding_type=model.position_embedding_type,
            rotary_percent=model.rotary_percent,
            rotary_base=model.rotary_base,  # typed int upstream; RoPE accepts any float theta
            rope_scaling=model.rope_scaling_factor is not None,
            rope_scaling_factor=model.rope_scaling_factor or 8.0,
            seq_len_interpolation_factor=model.rope_linear_scaling_factor,
            vp_stage=stage,
        )
        chunk.embedding_scale = model.embedding_scale
        if config.multi_latent_attention:
            # megatron-core's GPTModel builds no RoPE for MLA (each layer would make positions
            # 0..L-1 itself); the per-row table of its rotated dimensions comes from here
            # (models.mla).
            chunk.rotary_pos_emb = (
                RotaryEmbedding(
                    kv_channels=model.qk_rope_head_dim,
                    rotary_percent=1.0,
                    rotary_base=model.rotary_base,
                    use_cpu_initialization=config.use_cpu_initialization,
                )
                if model.rope_yarn_factor is None
                else yarn_rotary(model, model.qk_rope_head_dim, config.use_cpu_initialization)
            )
        elif model.rope_yarn_factor is not None:
            # gpt-oss: the layers rotate by the YaRN table (ScoringGPTModel._rotary_per_row); its
            # cos / sin scale is in the softmax scale (transformer_config.attention_fields).
            chunk.rotary_pos_emb = yarn_rotary(
                model, config.kv_channels, config.use_cpu_initialization
            )
        if model.local_rotary_base is not None:
            chunk.local_rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=model.rotary_percent,
                rotary_base=model.local_rotary_base,
                use_cpu_initialization=config.use_cpu_initialization,
            )
        if reward:
            attach_reward_head(chunk)
        place_chunk(chunk, config.params_dtype)
        chunk.thd = packed_format(chunk) == "thd"  # as its layers' core attention takes them
        chunk.fused_lm_head = lm_head_is_fused(model.fused_lm_head)
        if chunk.post_process and vocab > model.vocab_size and not reward:
            _mask_vocab_padding(chunk, model.vocab_size, vocab)
        chunks.append(chunk)
    return chunks


def yarn_rotary(model: ModelConfig, dim: int, cpu_init: bool) -> YarnRotaryEmbedding:
    """megatron-core's YaRN table over ``dim`` rotated dimensions per head for the model's
    ``rope_yarn_*`` fields (Peng et al. 2023; the frequencies of transformers'
    ``_compute_yarn_parameters``, ``truncate`` as ``correction_range_round_to_int``). Its
    ``get_emb`` returns (angles [L, 1, 1, dim], cos / sin scale)."""
    return YarnRotaryEmbedding(
        kv_channels=dim,
        rotary_base=model.rotary_base,
        use_cpu_initialization=cpu_init,
        scaling_factor=model.rope_yarn_factor,
        original_max_position_embeddings=model.rope_yarn_original_max_position_embeddings,
        beta_fast=model.rope_yarn_beta_fast,
        beta_slow=model.rope_yarn_beta_slow,
        mscale=model.rope_yarn_mscale,
        mscale_all_dim=model.rope_yarn_mscale_all_dim,
        correction_range_round_to_int=model.rope_yarn_truncate,
    )


def place_chunk(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """Put a freshly built chunk on the engine's device, in the model dtype: the one owner of
    both for every model the engine builds (policy, frozen reference, LoRA base, conversion).

    megatron-core never moves a model: Megatron-LM's ``get_model`` calls ``model.cuda()`` after
    building, and its DDP moves only trainable parameters (and only with the distributed
    optimizer). Modules made with plain factories (this package's norms, megatron-core's learned
    position embedding) are created on the host, so a frozen reference would keep them there.
    Likewise megatron-core's ``Float16Module`` casts the whole model (``module.bfloat16()``:
    every floating parameter and buffer); without it the learned position embedding stays fp32
    and meets bf16 weights. The MoE routers are already in the model dtype (megatron-core's
    ``Router.reset_parameters``) and compute in fp32 (``moe_router_dtype='fp32'``); an fp32
    ``expert_bias`` is restored by megatron-core itself before use.

    Args:
        chunk: a model chunk (its parameters and buffers anywhere, any floating dtype).
        dtype: the model dtype (``TransformerConfig.params_dtype``).
    """
    chunk.to(device=get_device(), dtype=dtype)


def _have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _enable_moe_patches(model: ModelConfig) -> None:
    """The compat patches megatron-core's MoE layer needs here (``dpo_megatron.compat``)."""
    from dpo_megatron.compat import moe_alltoall_on_cpu, moe_router_without_te

    if not _have_transformer_engine():
        moe_router_without_te.enable()
    if model.moe_token_dispatcher == "alltoall" and not is_cuda():
        moe_alltoall_on_cpu.enable()
    if model.moe_router_expert_bias:
        from dpo_megatron.compat import moe_expert_bias_padding_mask

        moe_expert_bias_padding_mask.enable()
    if model.add_bias_linear:  # gpt-oss's experts
        from dpo_megatron.compat import moe_expert_fc2_bias

        moe_expert_fc2_bias.enable()


def _mask_vocab_padding(chunk: ScoringGPTModel, vocab_size: int, padded: int) -> None:
    """Give the padding columns of the vocabulary a logit of -inf.

    Padding rows of the output weight are zero, so without this every padding id would get logit
    0 and a share of the softmax: log-probs would differ from the unpadded (HF) model. With -inf
    they get probability exactly 0 and zero gradient. Applied as a forward hook, so it holds for
    every caller of the output layer (evaluation's sampling, conversion checks), and as
    ``vocab_valid_columns`` for the log-prob head, which does not call the output layer.
    """
    shard = padded // parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    first_pad = max(vocab_size - start, 0)  # local column of the first padding id
    if first_pad >= shard:
        return  # this TP rank holds real tokens only
    chunk.vocab_valid_columns = first_pad

    def hook(module, inputs, output):
        logits, bias = output
        pad = torch.arange(first_pad, shard, device=logits.device)
        return logits.index_fill(-1, pad, float("-inf")), bias

    hook.masks_vocab_padding = True  # known to callers that compute the head themselves
    chunk.output_layer.register_forward_hook(hook)
