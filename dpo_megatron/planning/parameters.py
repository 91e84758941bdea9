"""Every parameter a rank holds, from the architecture and the layout alone: no model is built.

The planner's weights, gradients and optimizer state all follow from this list, so it mirrors
what ``models.gpt.build_model_chunks`` (megatron-core's ``GPTModel`` on the engine's layer
specs) creates on one rank, name for name: the shapes of megatron-core's tensor-parallel layers
(column-parallel: output rows / TP; row-parallel: input columns / TP; norms, routers and the
learned position table whole), the layers of each pipeline chunk (megatron-core's
``get_transformer_layer_offset``: chunk v of pipeline rank r holds layers
``v L / VPP + r L / (PP VPP)`` onwards, ``L / (PP VPP)`` of them), the vocabulary padded to a
multiple of TP (``models.transformer_config.padded_vocab_size``), the zero key/value groups of
``model.pad_attention_heads``, experts split over expert-parallel ranks, LoRA adapters
(``models.lora.LoRAAdapter``: column ``A [r, in]``, ``B [out / TP, r]``; row ``A [r, in / TP]``,
``B [out, r]``) and a reward model's ``[1, hidden]`` head. ``tests/planning`` checks the names
and sizes against real builds of every architecture family, at real sizes on the ``meta``
device.

Every tensor-parallel rank of a stage holds the same sizes (TP divides every split dimension,
or the layout is refused), as does every expert-parallel rank, so a pipeline stage stands for
all its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig

ADAPTER_SUFFIX = "_lora"
"""``models.lora.ADAPTER_SUFFIX``: an adapter is the submodule ``<layer>_lora`` beside it."""
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")


@dataclass(frozen=True)
class Param:
    """One parameter of a rank's chunk.

    Attributes:
        name: its name in the chunk (``decoder.layers.3.mlp.linear_fc1.weight``; layer numbers
            are local to the chunk, as megatron-core numbers them).
        numel: elements on this rank.
        trainable: it has a gradient (False: a LoRA run's frozen base).
        expert: an expert-parallel parameter (megatron-core's DDP keeps these in their own buffer,
            reduced over the expert data-parallel group).
        shared_embedding: the word embedding / output weight pair tied across the first and last
            pipeline stages (megatron-core's DDP gives it a bucket of its own).
    """

    name: str
    numel: int
    trainable: bool = True
    expert: bool = False
    shared_embedding: bool = False


def chunk_layers(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each model chunk of pipeline rank ``pp_rank`` (megatron-core's
    ``get_transformer_layer_offset``; one chunk without virtual pipelining).

    Raises:
        ValueError: the layers do not divide evenly into PP x VPP chunks.
    """
    pp = parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    if model.num_layers % (pp * vpp):
        raise ValueError(
            f"model.num_layers={model.num_layers} does not divide into "
            f"pipeline_model_parallel_size x virtual stages = {pp * vpp} chunks"
        )
    per_chunk = model.num_layers // (pp * vpp)
    return [
        list(
            range(
                v * pp * per_chunk + pp_rank * per_chunk,
                v * pp * per_chunk + (pp_rank + 1) * per_chunk,
            )
        )
        for v in range(vpp)
    ]


class _Chunk:
    """Collects one chunk's parameters under a name prefix."""

    def __init__(self, lora, tp: int, etp: int):
        self.params: list[Param] = []
        self.lora, self.tp, self.etp = lora, tp, etp

    def add(self, name: str, numel: int, expert: bool = False, shared: bool = False) -> None:
        trainable = self.lora is None
        self.params.append(Param(name, numel, trainable, expert, shared))

    def norm(self, prefix: str, model: ModelConfig, size: int) -> None:
        self.add(f"{prefix}.weight", size)
        if model.normalization == "LayerNorm":
            self.add(f"{prefix}.bias", size)

    def linear(
        self,
        prefix: str,
        out_features: int,
        in_features: int,
        mode: str,
        bias: bool,
        expert: bool = False,
    ) -> None:
        """A megatron-core Column/RowParallelLinear (and its LoRA adapter when targeted)."""
        tp = self.etp if expert else self.tp
        column = mode == "column"
        out_local = out_features // tp if column else out_features
        in_local = in_features if column else in_features // tp
        self.add(f"{prefix}.weight", out_local * in_local, expert)
        if bias:  # a column layer's bias is split with its rows; a row layer's is whole
            self.add(f"{prefix}.bias", out_local, expert)
        leaf = prefix.rsplit(".", 1)[-1]
        if self.lora is not None and leaf in self.lora.target_modules:
            rank = self.lora.rank
            adapter = f"{prefix}{ADAPTER_SUFFIX}"
            self.params.append(Param(f"{adapter}.lora_a", rank * in_local, True, expert))
            self.params.append(Param(f"{adapter}.lora_b", out_local * rank, True, expert))


def _attention(c: _Chunk, p: str, model: ModelConfig, heads: int, groups: int, d: int) -> None:
    h, tp = model.hidden_size, c.tp
    if model.kv_lora_rank is not None:  # multi-latent attention (megatron-core MLASelfAttention)
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        if model.q_lora_rank is None:
            c.linear(f"{p}.linear_q_proj", heads * qk, h, "column", False)
        else:
            # megatron-core's local MLA spec: column-parallel down projections (gather_output
            # False), their latent norms whole
            c.linear(f"{p}.linear_q_down_proj", model.q_lora_rank, h, "column", False)
            c.linear(f"{p}.linear_q_up_proj", heads * qk, model.q_lora_rank, "column", False)
        kv_down = model.kv_lora_rank + model.qk_rope_head_dim
        c.linear(f"{p}.linear_kv_down_proj", kv_down, h, "column", False)
        kv_up = heads * (model.qk_nope_head_dim + model.v_head_dim)
        c.linear(f"{p}.linear_kv_up_proj", kv_up, model.kv_lora_rank, "column", False)
        if model.q_lora_rank is not None:
            c.add(f"{p}.q_layernorm.weight", model.q_lora_rank)
        c.add(f"{p}.kv_layernorm.weight", model.kv_lora_rank)
        c.linear(f"{p}.linear_proj", h, heads * model.v_head_dim, "row", model.add_bias_linear)
        return
    if model.attention_sinks:
        c.add(f"{p}.core_attention.softmax_offset", heads // tp)
    c.linear(f"{p}.linear_proj", h, heads * d, "row", model.add_bias_linear)
    qkv_bias = model.add_qkv_bias or model.add_bias_linear
    c.linear(f"{p}.linear_qkv", (heads + 2 * groups) * d, h, "column", qkv_bias)
    if model.qk_layernorm:
        if model.qk_norm_scope == "projection":  # split over TP with the heads
            c.add(f"{p}.q_layernorm.weight", heads * d // tp)
            c.add(f"{p}.k_layernorm.weight", groups * d // tp)
        else:
            c.add(f"{p}.q_layernorm.weight", d)
            c.add(f"{p}.k_layernorm.weight", d)


def _mlp(c: _Chunk, p: str, model: ModelConfig, ffn: int, expert: bool = False) -> None:
    from dpo_megatron.models.transformer_config import GATED

    gated = model.activation in GATED
    bias = model.add_bias_linear
    c.linear(
        f"{p}.linear_fc1", (2 if gated else 1) * ffn, model.hidden_size, "column", bias, expert
    )
    c.linear(f"{p}.linear_fc2", model.hidden_size, ffn, "row", bias, expert)


def _moe(c: _Chunk, p: str, model: ModelConfig, ep: int) -> None:
    c.add(f"{p}.router.weight", model.num_experts * model.hidden_size)
    if model.add_bias_linear:
        c.add(f"{p}.router.bias", model.num_experts)
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    for e in range(model.num_experts // ep):
        _mlp(c, f"{p}.experts.local_experts.{e}", model, ffn, expert=True)
    if model.moe_shared_expert_ffn_hidden_size:
        _mlp(c, f"{p}.shared_experts", model, model.moe_shared_expert_ffn_hidden_size)


def _layer(c: _Chunk, p: str, model: ModelConfig, layer: int, parallel: ParallelConfig) -> None:
    from dpo_megatron.models.transformer_config import attention_heads

    heads, groups, d = attention_heads(model, c.tp)
    h = model.hidden_size
    pre = model.norm_placement in ("pre", "sandwich")
    post = model.norm_placement in ("post", "sandwich")
    if pre:
        c.norm(f"{p}.input_layernorm", model, h)
    _attention(c, f"{p}.self_attention", model, heads, groups, d)
    if pre:
        c.norm(f"{p}.pre_mlp_layernorm", model, h)
    if model.num_experts and layer >= model.moe_first_dense_layers:
        _moe(c, f"{p}.mlp", model, parallel.expert_model_parallel_size)
    else:
        _mlp(c, f"{p}.mlp", model, model.ffn_hidden_size)
    if post:
        c.norm(f"{p}.post_attention_layernorm", model, h)
        c.norm(f"{p}.post_mlp_layernorm", model, h)


def stage_parameters(
    model: ModelConfig, parallel: ParallelConfig, pp_rank: int, lora=None
) -> list[list[Param]]:
    """The parameters of each chunk of pipeline rank ``pp_rank`` (any of its TP / CP / DP / EP
    ranks), in registration order (the order megatron-core's DDP reads them in).

    Args:
        model: the resolved architecture (``head`` decides LM head or reward head).
        parallel: the layout.
        pp_rank: the pipeline stage, 0 .. PP - 1.
        lora: the ``lora`` section when ``lora.enabled`` (adapters trainable, the rest frozen),
            else None.

    Raises:
        ValueError: a layout the architecture does not divide into (heads / TP, layers / PP).
    """
    from dpo_megatron.models.transformer_config import padded_vocab_size

    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    layers = chunk_layers(model, parallel, pp_rank)
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp) // tp
    h, reward = model.hidden_size, model.head == "reward"
    tied = model.tie_word_embeddings and not reward
    out = []
    for v, chunk_layer_ids in enumerate(layers):
        c = _Chunk(lora, tp, parallel.expert_tensor_parallel())
        first = pp_rank == 0 and v == 0
        last = pp_rank == pp - 1 and v == len(layers) - 1
        if first:
            c.add("embedding.word_embeddings.weight", vocab * h, shared=tied and pp > 1)
            if model.position_embedding_type == "learned_absolute":
                c.add("embedding.position_embeddings.weight", model.max_position_embeddings * h)
        for local, layer in enumerate(chunk_layer_ids):
            _layer(c, f"decoder.layers.{local}", model, layer, parallel)
        if last:
            c.norm("decoder.final_layernorm", model, h)
            if reward:
                c.add("reward_head.weight", h)  # no LoRA with a reward model (config.py)
            elif not (tied and first):  # tied at PP 1: the embedding is the output weight
                c.add("output_layer.weight", vocab * h, shared=tied)
        out.append(c.params)
    return out


def stage_parameter_count(
    model: ModelConfig, parallel: ParallelConfig, pp_rank: int, lora=None
) -> int:
    """Elements of every parameter of pipeline rank ``pp_rank`` (all its chunks)."""
    return sum(p.numel for chunk in stage_parameters(model, parallel, pp_rank, lora) for p in chunk)
