"""Build megatron-core ``GPTModel`` chunks for the Llama family (and GPT-2) from a ModelConfig.

The policy and the frozen reference are built by the same function, so they are sharded
identically: each pipeline rank holds its layers of both.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.norms import norm_class
from dpo_megatron.parallel.layout import ParallelConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, tanh approximation (Hendrycks & Gimpel 2016, sec. 2); HF's ``gelu_new``."""
    return F.gelu(x, approximate="tanh")


def resolve_params_dtype(name: str) -> torch.dtype:
    """'auto' -> bf16 with CUDA, fp32 without; else the named dtype.

    Raises:
        ValueError: for names other than auto / float32 / bfloat16.
    """
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"model.params_dtype must be auto, float32 or bfloat16, got {name!r}")
    return dtypes[name]


def use_transformer_engine(impl: str) -> bool:
    """Whether to build with the transformer-engine layer spec.

    Raises:
        ValueError: for 'transformer_engine' when it is not importable or CUDA is absent.
    """
    available = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")
    if impl == "transformer_engine":
        if not available:
            raise ValueError("model.transformer_impl=transformer_engine needs CUDA and the "
                             "transformer-engine package (pip install .[gpu])")
        return True
    if impl not in ("auto", "local"):
        raise ValueError(f"model.transformer_impl must be auto, local or transformer_engine, "
                         f"got {impl!r}")
    return impl == "auto" and bool(available)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Round the vocabulary up so each TP rank holds an equal, granule-aligned slice.

    Example: 49,152 with divisible_by 1 and TP 2 stays 49,152; 50,257 at TP 2 becomes 50,258.
    """
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def attention_heads(model: ModelConfig, tensor_model_parallel_size: int) -> tuple[int, int, int]:
    """(query heads, key/value groups, head dim) of the megatron model at this TP size.

    With ``model.pad_attention_heads`` the groups are rounded up to a multiple of
    ``model.pad_attention_heads_multiple`` (independent of TP, so checkpoints reshard), each extra
    group carrying the usual number of query heads with all-zero weights; e.g. 9 heads / 3 groups
    -> 12 heads / 4 groups, head dim unchanged (64).

    Raises:
        ValueError: heads not divisible by groups, or TP not dividing the (padded) groups.
    """
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = model.kv_channels or model.hidden_size // heads
    if heads % groups:
        raise ValueError(f"model.num_attention_heads={heads} is not divisible by "
                         f"model.num_query_groups={groups}")
    tp = tensor_model_parallel_size
    if model.pad_attention_heads:
        multiple = model.pad_attention_heads_multiple
        padded = -(-groups // multiple) * multiple
        heads, groups = padded * (heads // groups), padded
        if groups % tp:
            raise ValueError(
                f"model has {groups} key/value groups after padding to a multiple of "
                f"model.pad_attention_heads_multiple={multiple}, not divisible by "
                f"parallel.tensor_model_parallel_size={tp}: set the multiple to a multiple of {tp}")
    elif groups % tp or heads % tp:
        raise ValueError(
            f"model has {heads} attention heads and {groups} key/value heads; both must be "
            f"divisible by parallel.tensor_model_parallel_size={tp} (or set "
            f"model.pad_attention_heads=true to add zero heads)")
    return heads, groups, head_dim


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig for this architecture and layout.

    Dropout is always 0: DPO's log-ratios must be computed by the same deterministic function for
    policy and reference (and the pipeline compares chosen with rejected).

    Raises:
        ValueError: heads or query groups not divisible by TP, layers not divisible by PP, or an
            unknown activation.
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    heads, groups, head_dim = attention_heads(model, tp)
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    if model.num_layers % (pp * vpp):
        raise ValueError(
            f"model has {model.num_layers} layers, not divisible by "
            f"parallel.pipeline_model_parallel_size={pp} x virtual stages {vpp}")
    if model.activation not in ("swiglu", "gelu"):
        raise ValueError(f"model.activation must be swiglu or gelu, got {model.activation!r}")
    dtype = resolve_params_dtype(model.params_dtype)
    swiglu = model.activation == "swiglu"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else gelu_tanh,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias or model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        # gloo matches point-to-point messages between two ranks in posting order. Batched p2p
        # posts [send_prev, recv_prev, send_next, recv_next] on every rank, so with interleaved
        # (virtual) pipelining at PP 2, where the previous and the next rank are the same peer, an
        # activation lands in a gradient buffer of the same shape: silently wrong numbers. The
        # unbatched path orders sends and receives by rank parity, which pairs them correctly.
        batch_p2p_comm=torch.cuda.is_available(),
        # Loss is normalised by the global number of pairs: see dpo_megatron.training.step.
        calculate_per_token_loss=True,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
    )


class SDPAttention(DotProductAttention):
    """megatron-core's local core attention, computed by ``torch.nn.functional.
    scaled_dot_product_attention`` (fused flash / memory-efficient kernels on CPU and GPU).

    Same inputs and output as ``DotProductAttention`` (query [sq, b, np, hn], key / value
    [sk, b, ng, hn] -> context [sq, b, np * hn]), same math (softmax(q k^T * scale) v, causal or
    the given mask: True = masked), but the [b, np, sq, sk] scores and probabilities are neither
    materialised nor kept for backward: on SmolLM2-135M at 8 x 512 tokens that is 150 MB per layer
    and ~5x less attention time on CPU. Features it does not cover (sliding windows, softmax
    offsets, query-key layer scaling, attention dropout) fall back to the parent.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        unsupported = (self.scale_mask_softmax.window_size is not None
                       or self.softmax_offset is not None
                       or self.config.apply_query_key_layer_scaling
                       or (self.training and self.attention_dropout.p > 0)
                       or attention_bias is not None or packed_seq_params is not None)
        if unsupported:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def _layer_spec(model: ModelConfig, config: TransformerConfig, vp_stage: Optional[int]
                ) -> ModuleSpec:
    """Transformer-block spec: TE layers when chosen, else local layers with SP-aware norms."""
    if use_transformer_engine(model.transformer_impl):
        return get_gpt_layer_with_transformer_engine_spec()
    layer = get_gpt_layer_local_spec(normalization=model.normalization)
    if model.local_attention == "sdpa":
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    elif model.local_attention != "megatron":
        raise ValueError(f"model.local_attention must be sdpa or megatron, got "
                         f"{model.local_attention!r}")
    norm = norm_class(model.normalization)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm),
    )


def build_model_chunks(model: ModelConfig, parallel: ParallelConfig) -> list[GPTModel]:
    """This rank's model chunks (one, or one per virtual pipeline stage), randomly initialised.

    Requires megatron-core's parallel state (``dpo_megatron.parallel.initialize_distributed``).
    Outputs of each chunk's forward on the last stage are vocab-parallel logits
    [batch, seq, padded_vocab / TP] (fp32 on CPU, model dtype on GPU).
    """
    config = build_transformer_config(model, parallel)
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                              parallel.tensor_model_parallel_size)
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(model, config, stage),
            vocab_size=vocab,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type=model.position_embedding_type,
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


@contextlib.contextmanager
def rotary_position_ids(model, position_ids: torch.Tensor) -> Iterator[None]:
    """Within the block, RoPE rotates each row's positions by ``position_ids`` [b, S].

    megatron-core's ``GPTModel`` applies RoPE at positions 0..S-1 of every row (it uses
    ``position_ids`` only for learned embeddings). Packed rows hold several sequences whose
    positions restart at 0, so for one forward the model's rotary module returns the per-row
    table ``emb[position_ids]`` as [S, b, 1, dim], which megatron-core's RoPE application
    broadcasts against [S, b, heads, dim] exactly like its own [S, 1, 1, dim]. The frequencies
    ``p * inv_freq`` are the padded path's, element for element. A model without RoPE (learned
    positions take ``position_ids`` natively) is left alone.
    """
    module = getattr(model, "module", model)  # DDP wrapper
    rope = getattr(module, "rotary_pos_emb", None)
    if rope is None or getattr(module, "position_embedding_type", "rope") != "rope":
        yield
        return

    def per_row(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        table = rope.get_emb(int(position_ids.max()) + 1)[:, 0, 0, :]  # [P, dim]
        return table[position_ids.to(table.device)].transpose(0, 1).unsqueeze(2)

    rope.forward = per_row  # instance attribute: shadows the (lru-cached) class method
    try:
        yield
    finally:
        del rope.forward


@contextlib.contextmanager
def output_positions(model, index: torch.Tensor) -> Iterator[None]:
    """Within the block, the last stage's output layer projects only the positions ``index``.

    DPO scores completion tokens only; prompt and padding logits are never used. Projecting
    just the scored hidden states skips their share of the vocabulary matmul and never builds a
    [tokens, V/TP] logits tensor for them (the same idea as TRL's fused LM head).

    Args:
        index: [n] int64 flat positions into the [b, s] input (row-major: ``i * s + t``).

    While active, the chunk's output on the last stage is [1, n, V/TP] logits of those
    positions, in ``index`` order. Under sequence parallelism the hidden states are all-gathered
    along the sequence first and the layer runs as without it: its input copy all-reduces the
    input gradient over TP, so the gather's backward only splits (no second reduction).
    Chunks without an output layer (not the last stage) are left alone.
    """
    module = getattr(model, "module", model)  # DDP wrapper
    layer = getattr(module, "output_layer", None) if getattr(module, "post_process", False) \
        else None
    if layer is None:
        yield
        return
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    original = layer.forward
    sequence_parallel = layer.sequence_parallel

    def selected(hidden_states, *args, **kwargs):  # [s(/tp), b, h] -> [n, 1, V/TP]
        if sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        s, b, h = hidden_states.shape
        picked = hidden_states.transpose(0, 1).reshape(b * s, h).index_select(0, index)
        return original(picked.unsqueeze(1), *args, **kwargs)

    layer.forward = selected
    layer.sequence_parallel = False  # the gather above replaced the layer's own
    try:
        yield
    finally:
        layer.sequence_parallel = sequence_parallel
        del layer.forward
