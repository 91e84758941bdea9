"""megatron-core ``GPTModel`` chunks for the supported architectures, with the two inputs a DPO
step needs beyond megatron-core's own forward.

The policy and the frozen reference are built by the same function, so they are sharded
identically: each pipeline rank holds its layers of both.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from dpo_megatron.models.attention import attention_mask_from_segments
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.moe import set_aux_loss_weight
from dpo_megatron.models.specs import layer_spec
from dpo_megatron.models.transformer_config import build_transformer_config, padded_vocab_size
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.parallel.device import is_cuda


class DPOGPTModel(GPTModel):
    """``GPTModel`` whose forward also takes what a DPO micro-batch carries
    (``dpo_megatron.data.batch.MicroBatch``):

    * ``position_ids`` rotate RoPE row by row. megatron-core's forward applies RoPE at positions
      0..L-1 of every row and reads ``position_ids`` only for learned embeddings; packed rows
      restart positions at every sequence, so here RoPE uses the per-row table
      ``emb[position_ids]`` [L, R, 1, dim], which megatron-core's RoPE application broadcasts
      against [L, R, heads, dim] exactly like its own [L, 1, 1, dim] (same frequencies, element
      for element, as the padded path).
    * ``segment_ids`` [R, L] (packed rows) become the attention mask on the device
      (``models.attention``); None means one causal sequence per row.
    * ``padding_mask`` [R, L] bool (True = padding, megatron-core's convention) keeps padding
      tokens out of MoE routers' load-balancing loss; ``moe_aux_loss_weight`` is what the step's
      gradient division counts this micro-batch as (its pairs: ``dpo_megatron.models.moe``).
      Both only matter for mixture-of-experts models.
    * ``output_index`` [n]: on the last stage only these flat positions (``r * L + t``) of the
      [R, L] input are projected onto the vocabulary. DPO scores completion tokens only, so prompt
      and padding hidden states never meet the LM head and no [R * L, V/TP] logits tensor is
      built for them (the idea of TRL's fused LM head). Under sequence parallelism the hidden
      states are all-gathered along the sequence first and the output layer runs without its
      own gather (as megatron-core's GPTModel does when it keeps only the last token's logits).

    Outputs: hidden states [L(/TP), R, h] off the last stage; on it, vocab-parallel logits
    [1, n, V/TP] with ``output_index`` (in that order), else [R, L, V/TP].
    """

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, *,
                segment_ids: Optional[torch.Tensor] = None,
                output_index: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None,
                moe_aux_loss_weight: float = 1.0) -> torch.Tensor:
        if segment_ids is not None:
            attention_mask = attention_mask_from_segments(segment_ids)
        decoder_input = (self.embedding(input_ids=input_ids, position_ids=position_ids)
                         if self.pre_process else None)  # later stages: set_input_tensor
        if self.config.num_moe_experts:
            set_aux_loss_weight(self, moe_aux_loss_weight)
            padding_mask = self._local_padding_mask(padding_mask)
        else:
            padding_mask = None
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     rotary_pos_emb=self._rotary_per_row(position_ids),
                                     padding_mask=padding_mask)
        if not self.post_process:
            return hidden_states
        return self._logits(hidden_states, output_index)

    def _local_padding_mask(self, padding_mask: Optional[torch.Tensor]
                            ) -> Optional[torch.Tensor]:
        """[R, L] -> this TP rank's [R, L/TP] slice under sequence parallelism (the routers see
        only their slice of the sequence), on every pipeline stage."""
        if padding_mask is None or not self.config.sequence_parallel:
            return padding_mask
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        return padding_mask.chunk(tp, dim=1)[rank].contiguous()

    def _rotary_per_row(self, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """[L, R, 1, dim] RoPE table of each row's positions, or None without RoPE."""
        if self.position_embedding_type != "rope":
            return None
        table = self.rotary_pos_emb.get_emb(int(position_ids.max()) + 1)[:, 0, 0, :]  # [P, dim]
        return table[position_ids.to(table.device)].transpose(0, 1).unsqueeze(2)

    def _logits(self, hidden_states: torch.Tensor,
                output_index: Optional[torch.Tensor]) -> torch.Tensor:
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else None)
        if output_index is None:
            logits, _ = self.output_layer(hidden_states, weight=weight)
            return logits.transpose(0, 1).contiguous()  # [L, R, V/TP] -> [R, L, V/TP]
        sequence_parallel = self.output_layer.sequence_parallel
        if sequence_parallel:
            # The output layer's input copy all-reduces the input gradient over TP, so the
            # gather's backward only splits (tensor_parallel_output_grad=False).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        length, rows, hidden = hidden_states.shape
        picked = hidden_states.transpose(0, 1).reshape(rows * length, hidden)
        # [1, n, h]: the n positions as one "sequence" of batch n, so the logits come out as
        # [1, n, V/TP] with plain strides. (A transposed [n, 1, V/TP] gives a gradient whose
        # strides send megatron-core's frozen-weight backward, taken when the output layer is
        # frozen as under LoRA, into a slow batched matmul: ~15x the time on the CPU.)
        picked = picked.index_select(0, output_index).unsqueeze(0)
        self.output_layer.sequence_parallel = False  # gathered above
        try:
            logits, _ = self.output_layer(picked, weight=weight)
        finally:
            self.output_layer.sequence_parallel = sequence_parallel
        return logits  # [1, n, V/TP]


def build_model_chunks(model: ModelConfig, parallel: ParallelConfig) -> list[DPOGPTModel]:
    """This rank's model chunks (one, or one per virtual pipeline stage), randomly initialised
    on the engine's device (``dpo_megatron.parallel.device``).

    Requires megatron-core's parallel state (``dpo_megatron.parallel.initialize_distributed``).
    Outputs of each chunk's forward on the last stage are vocab-parallel logits
    (``DPOGPTModel``; fp32 on CPU, the model dtype on GPU).
    """
    config = build_transformer_config(model, parallel)
    if model.num_experts:
        _enable_moe_patches(model)
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                              parallel.tensor_model_parallel_size)
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = DPOGPTModel(
            config=config,
            transformer_layer_spec=layer_spec(model, config, stage),
            vocab_size=vocab,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type=model.position_embedding_type,
            rotary_percent=model.rotary_percent,
            rotary_base=model.rotary_base,  # typed int upstream; RoPE accepts any float theta
            rope_scaling=model.rope_scaling_factor is not None,
            rope_scaling_factor=model.rope_scaling_factor or 8.0,
            seq_len_interpolation_factor=model.rope_linear_scaling_factor,
            vp_stage=stage,
        )
        if chunk.post_process and vocab > model.vocab_size:
            _mask_vocab_padding(chunk.output_layer, model.vocab_size, vocab)
        chunks.append(chunk)
    return chunks


def _enable_moe_patches(model: ModelConfig) -> None:
    """The compat patches megatron-core's MoE layer needs here (``dpo_megatron.compat``)."""
    import importlib.util

    from dpo_megatron.compat import moe_alltoall_on_cpu, moe_router_without_te

    if importlib.util.find_spec("transformer_engine") is None:
        moe_router_without_te.enable()
    if model.moe_token_dispatcher == "alltoall" and not is_cuda():
        moe_alltoall_on_cpu.enable()


def _mask_vocab_padding(output_layer: torch.nn.Module, vocab_size: int, padded: int) -> None:
    """Give the padding columns of the vocabulary a logit of -inf.

    Padding rows of the output weight are zero, so without this every padding id would get logit
    0 and a share of the softmax: log-probs would differ from the unpadded (HF) model. With -inf
    they get probability exactly 0 and zero gradient. Applied as a forward hook, so it holds for
    every caller of the output layer (training, evaluation, sampling).
    """
    shard = padded // parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    first_pad = max(vocab_size - start, 0)  # local column of the first padding id
    if first_pad >= shard:
        return  # this TP rank holds real tokens only

    def hook(module, inputs, output):
        logits, bias = output
        pad = torch.arange(first_pad, shard, device=logits.device)
        return logits.index_fill(-1, pad, float("-inf")), bias

    output_layer.register_forward_hook(hook)
