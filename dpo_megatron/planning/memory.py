"""Bytes one rank holds during a DPO run: what is allocated on the device, as
``torch.cuda.max_memory_allocated`` counts it (the caching allocator's slack and the CUDA / NCCL
context come on top: :mod:`dpo_megatron.planning.hardware` reserves room for them).

Static memory is exact, given the parameter list (:mod:`dpo_megatron.planning.parameters`):

* **weights**: megatron-core's DDP moves trainable parameters into one buffer per chunk (dense
  and expert-parallel apart) when the distributed optimizer is on, each parameter starting at a
  multiple of 64 elements and the buffer padded to a multiple of lcm(DP, 128) (a shared
  embedding in a bucket of its own); otherwise they stay as built. Frozen parameters (a LoRA
  base) stay as built.
* **grads**: the same buffers' fp32 gradients (``grad_reduce_in_fp32``).
* **optimizer**: Adam's two moments (fp32) for every element of this data-parallel rank's shard
  of each buffer (padding excluded), plus an fp32 copy of those elements when the model is bf16
  (megatron-core's mixed-precision main parameters); without the distributed optimizer, for every
  trainable element.
* **reference**: the frozen reference model (same layout, model dtype), unless the reference is
  precomputed (built for one pass, then freed), a LoRA run's own base, or offloaded to the host.

Activations follow the tensors the engine's layers save for backward, per token of a
micro-batch (checked against autograd's saved tensors on the CPU): per layer the norms'
inputs, the linear layers' inputs, the fused QKV output, the rotated queries and keys, the
attention output and its log-sum-exp (flash-style kernels keep no [s, s] scores), the gated
MLP's [2 ffn] pre-activation and its [ffn] output (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4.1, for the same accounting of a GPT layer),
divided by TP inside attention and MLP and by TP everywhere under sequence parallelism, by CP
along the sequence. A pipeline stage holds ``min(m, PP - r)`` micro-batches of its layers in
1F1B (Narayanan et al. 2021, sec. 2.2), ``L (1 + (PP - 1) / (PP VPP))`` layers' worth on the
first stage when interleaved. Recomputation keeps only the checkpointed inputs and adds one
group's activations back while its backward runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.planning.parameters import Param, chunk_layers, stage_parameters

FP32 = 4
LOGITS_CHUNK_ELEMENTS = 2**22
"""``models.logprobs.LOGITS_CHUNK_ELEMENTS``: logits per chunk of the unfused head's log-softmax."""
FUSED_CHUNK_ELEMENTS = 2**24
"""``models.logprobs.DEFAULT_CHUNK_ELEMENTS``: logits per chunk of the fused LM head."""


@dataclass(frozen=True)
class Workload:
    """What one step computes, whatever the layout (worst case: every sequence as long as
    ``data.max_length`` allows).

    Attributes:
        max_length: tokens of one sequence (prompt + completion), ``data.max_length``.
        prompt_fraction: the prompt's share of a sequence's tokens, in [0, 1).
        sequences_per_item: 2 for pairs (KTO: the completion and its KL completion; a reward
            model: chosen and rejected), 1 for SFT examples.
        share_prompt: the prompt runs once per pair (``packing.share_prompt``).
        lm_head: log-probs of the completion tokens (False: a reward model's scalar head).
        global_batch_size: items per optimizer step.
        micro_batch_size: items per micro-batch.
        reference: 'model' (a forward of the reference each step), 'precomputed' (one pass before
            training) or 'none' (a loss without one).
        reference_is_base: the reference is the policy's own frozen base (LoRA): no copy of
            the weights exists, only the passes.
        reference_offload: the frozen copy waits in host memory between passes.
        policy_statistic_pass: one more forward-only policy pass per step (beta-DPO's batch
            statistic).
    """

    max_length: int
    prompt_fraction: float
    sequences_per_item: int
    share_prompt: bool
    lm_head: bool
    global_batch_size: int
    micro_batch_size: int
    reference: str
    reference_is_base: bool = False
    reference_offload: bool = False
    policy_statistic_pass: bool = False

    def item_tokens(self) -> int:
        """Tokens one item puts through the layers (a shared prompt once)."""
        completion = self.max_length - self.prompt_tokens()
        if self.share_prompt and self.sequences_per_item > 1:
            return self.max_length + (self.sequences_per_item - 1) * completion
        return self.sequences_per_item * self.max_length

    def prompt_tokens(self) -> int:
        return int(self.max_length * self.prompt_fraction)

    def scored_tokens(self) -> int:
        """Tokens of one item projected onto the vocabulary (every completion token)."""
        return self.sequences_per_item * (self.max_length - self.prompt_tokens())


@dataclass(frozen=True)
class Numerics:
    """How the run computes: ``model.params_dtype`` resolved, the LM head's form, the attention
    kernel's treatment of grouped keys, and megatron-core's gradient-accumulation fusion."""

    bf16: bool
    fused_lm_head: bool
    expand_kv: bool = False
    """Keys / values repeated to every query head before attention (CUDA's fp32 kernels and the
    sink attention do; flash kernels take grouped keys)."""
    host: bool = False
    """On the host (CPU), where the engine runs its local layers, what backward can remake is
    not kept (``utils.saved_activations``): the RMSNorm outputs, megatron-core's SwiGLU product
    (run eagerly, ``compat.eager_fusions``), and RoPE's cos / sin beyond one pair per forward
    (``compat.rope_tables_once``). On an accelerator the planner counts them all (transformer-
    engine's layers keep their own; an overestimate for the local layers)."""

    @property
    def bytes(self) -> int:
        return 2 if self.bf16 else 4


@dataclass
class RankMemory:
    """One rank's bytes (the stage that needs the most of its layout).

    Attributes:
        pp_rank: the pipeline stage these numbers are for.
        params: parameter elements on the rank (policy; adapters included).
        weights, grads, optimizer, reference, activations, logits, workspace: bytes (see the
            module docstring; ``logits``: what the LM head keeps and works in on the last stage;
            ``workspace``: the largest short-lived working set on top, in backward or in the
            optimizer step).
        phases: peak bytes of each phase (``training``, ``reference``, ``optimizer``).
    """

    pp_rank: int
    params: int
    weights: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    logits: int
    workspace: int
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The peak: the largest phase."""
        return max(self.phases.values())

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "reference": self.reference,
            "activations": self.activations,
            "logits": self.logits,
            "workspace": self.workspace,
            "total": self.total,
        }


# ----------------------------------------------------------------------------------------------
# static memory: megatron-core's DDP buffers and the distributed optimizer's shards


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def ddp_buckets(
    params: list[Param], dp: int, distributed_optimizer: bool
) -> list[tuple[int, list]]:
    """megatron-core ``_ParamAndGradBuffer``'s layout of one buffer's ``params`` (reverse order,
    one bucket: no overlapped reduce): [(bucket size, [(param, start, end)])], offsets relative
    to the bucket. With the distributed optimizer each parameter starts at a multiple of 64 and
    each bucket is padded to a multiple of lcm(dp, 128); a shared embedding gets its own bucket."""
    buckets: list[tuple[int, list]] = []
    current: list = []
    offset = 0

    def close() -> None:
        nonlocal current, offset
        if current:
            size = _pad(offset, math.lcm(dp, 128)) if distributed_optimizer else offset
            buckets.append((size, current))
        current, offset = [], 0

    for p in reversed(params):
        if distributed_optimizer:
            offset = _pad(offset, 64)
        if p.shared_embedding and distributed_optimizer:
            close()
        current.append((p, offset, offset + p.numel))
        offset += p.numel
        if p.shared_embedding and distributed_optimizer:
            close()
    close()
    return buckets


def _shard_elements(buckets: list[tuple[int, list]], dp: int, dp_rank: int) -> int:
    """Elements of real parameters in data-parallel rank ``dp_rank``'s shard of the buckets."""
    total = 0
    for size, entries in buckets:
        lo, hi = dp_rank * size // dp, (dp_rank + 1) * size // dp
        total += sum(max(0, min(end, hi) - max(start, lo)) for _, start, end in entries)
    return total


def static_bytes(
    chunks: list[list[Param]],
    parallel: ParallelConfig,
    numerics: Numerics,
    distributed_optimizer: bool,
    optimizer: str = "adam",
    dp_rank: int | None = None,
    expert_dp_rank: int | None = None,
) -> dict[str, int]:
    """Weights, gradients and optimizer state of one rank holding ``chunks`` (its parameters).

    Args:
        dp_rank: the rank in the data-parallel (x context-parallel) group whose shard of the
            dense parameters' optimizer state to count; expert_dp_rank: likewise in the expert
            data-parallel group (None: the largest shard).

    Returns:
        {"params", "weights", "grads", "optimizer"}: elements, then bytes.
    """
    dense_dp = parallel.data_parallel_size * parallel.context_parallel_size
    expert_dp = parallel.launch_world_size() // (
        parallel.expert_tensor_parallel()
        * parallel.expert_model_parallel_size
        * parallel.pipeline_model_parallel_size
    )
    state_per_element = {"adam": 2 * FP32, "sgd": FP32}[optimizer]
    if numerics.bf16:
        state_per_element += FP32  # the fp32 main copy of a bf16 parameter
    weights = grads = optimizer_bytes = params = 0
    for chunk in chunks:
        params += sum(p.numel for p in chunk)
        weights += sum(p.numel for p in chunk if not p.trainable) * numerics.bytes
        groups = ((False, dense_dp, dp_rank), (True, expert_dp, expert_dp_rank))
        for expert, dp, rank in groups:
            group = [p for p in chunk if p.trainable and p.expert == expert]
            if not group:
                continue
            buckets = ddp_buckets(group, dp, distributed_optimizer)
            size = sum(s for s, _ in buckets)
            grads += size * FP32
            if distributed_optimizer:
                weights += size * numerics.bytes
                ranks = range(dp) if rank is None else [rank]
                shard = max(_shard_elements(buckets, dp, r) for r in ranks)
            else:
                weights += sum(p.numel for p in group) * numerics.bytes
                shard = sum(p.numel for p in group)
            optimizer_bytes += shard * state_per_element
    return {"params": params, "weights": weights, "grads": grads, "optimizer": optimizer_bytes}


# ----------------------------------------------------------------------------------------------
# activations


@dataclass(frozen=True)
class _Shape:
    """Per-rank widths of one layer (elements per token)."""

    h: int
    q: int  # query heads x head dim / TP
    kv: int  # key/value groups x head dim / TP
    heads: int  # query heads / TP
    rope: int  # rotated dims of one head (the per-row cos / sin tables)


def _attention_shape(model: ModelConfig, tp: int) -> _Shape:
    from dpo_megatron.models.transformer_config import attention_heads

    if model.kv_lora_rank is not None:
        heads = model.num_attention_heads
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        return _Shape(model.hidden_size, heads * qk // tp, heads * qk // tp, heads // tp, 0)
    heads, groups, d = attention_heads(model, tp)
    rope = int(d * model.rotary_percent) if model.position_embedding_type == "rope" else 0
    return _Shape(model.hidden_size, heads * d // tp, groups * d // tp, heads // tp, rope)


def _norm_bytes(model: ModelConfig, b: int) -> int:
    """A norm's saved input and its fp32 statistics (RMSNorm: 1/rms; LayerNorm: mean, 1/std)."""
    return b * model.hidden_size + FP32 * (2 if model.normalization == "LayerNorm" else 1)


def layer_activation_bytes(
    model: ModelConfig,
    parallel: ParallelConfig,
    numerics: Numerics,
    layer: int,
    recompute_modules: tuple[str, ...] = (),
) -> float:
    """Bytes one layer saves for backward per token of a micro-batch on one rank (before the
    CP split), without full recomputation.

    ``recompute_modules``: megatron-core's selective recomputation (``core_attn``: the
    attention output and log-sum-exp are recomputed; ``layernorm``: the norms' outputs that the
    next linear layers would keep; ``mlp`` / ``moe``: everything inside the MLP but its input).
    """
    from dpo_megatron.models.transformer_config import GATED

    tp = parallel.tensor_model_parallel_size
    sp = tp if parallel.sequence_parallel else 1
    b = numerics.bytes
    s = _attention_shape(model, tp)
    h = model.hidden_size
    norms = 0.0  # on the sequence-parallel shard
    if model.norm_placement in ("pre", "sandwich"):
        norms += 2 * _norm_bytes(model, b)
        # the normed inputs the QKV and first MLP linears keep (on the host an RMSNorm's are
        # remade in backward from its saved input: Numerics.host)
        remade = numerics.host and model.normalization == "RMSNorm"
        if "layernorm" not in recompute_modules and not remade:
            norms += 2 * b * h
    else:  # post-norm: the linears read the residual stream itself
        norms += 2 * b * h
    if model.norm_placement in ("post", "sandwich"):
        norms += 2 * _norm_bytes(model, b)
    attention = _attention_bytes(model, s, numerics, layer, recompute_modules)
    moe = model.num_experts and layer >= model.moe_first_dense_layers
    if moe:
        mlp = _moe_bytes(model, parallel, b, recompute_modules)
    elif "mlp" in recompute_modules:
        mlp = 0.0
    else:
        ffn = model.ffn_hidden_size // tp
        gated = model.activation in GATED
        # [2 ffn] pre-activation (or [ffn] twice), [ffn] out: a SwiGLU product on the host is
        # remade in backward
        remade = gated and numerics.host and model.activation == "swiglu"
        mlp = b * ffn * (2 if remade else 3 if gated else 2)
    return norms / sp + attention + mlp


def _attention_bytes(
    model: ModelConfig, s: _Shape, numerics: Numerics, layer: int, recompute: tuple[str, ...]
) -> float:
    b = numerics.bytes
    if model.kv_lora_rank is not None:  # MLA: latents, their norms, the up-projected q, k, v
        q_lora = model.q_lora_rank or 0
        latents = 2 * q_lora + 2 * model.kv_lora_rank + model.qk_rope_head_dim
        v = s.heads * model.v_head_dim
        kept = b * (latents + 3 * s.q + s.heads * (model.qk_nope_head_dim + model.v_head_dim) + v)
        out = b * v + FP32 * s.heads
        return kept + (0 if "core_attn" in recompute else out)
    rotated = bool(s.rope) and layer not in (model.no_rope_layers or ())
    qk_norm = (
        b * (s.q + s.kv) + FP32 * (s.heads + s.kv // max(1, s.q // s.heads))
        if (model.qk_layernorm)
        else 0
    )
    if numerics.expand_kv or model.attention_sinks:
        # keys and values repeated to every head: the kernel keeps those, not the QKV output
        kept = b * 3 * s.q
    else:
        # the fused QKV output (values are a view of it), rotated queries and keys
        kept = b * (s.q + 2 * s.kv) + (b * (s.q + s.kv) if rotated else 0)
    # cos and sin, for queries and for keys (on the host one pair per forward: stage_memory)
    tables = 4 * b * s.rope if rotated and not numerics.host else 0
    out = b * s.q + FP32 * s.heads  # attention output (the projection's input) and log-sum-exp
    return qk_norm + kept + tables + (0 if "core_attn" in recompute else out)


def _moe_bytes(model: ModelConfig, parallel: ParallelConfig, b: int, recompute) -> float:
    """Per token of the rank's sequence-parallel shard: the router's fp32 scores, then per
    routed copy the expert's input, pre-activation, activation and output (balanced routing:
    every rank receives as many routed copies as it sends)."""
    if "moe" in recompute:
        return 0.0
    tp = parallel.tensor_model_parallel_size
    etp = parallel.expert_tensor_parallel()
    sp = tp if parallel.sequence_parallel else 1
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    k = model.moe_router_topk
    routed = k * (2 * b * model.hidden_size * etp + 3 * b * ffn)
    router = FP32 * 2 * model.num_experts + b * model.hidden_size
    shared = (
        3 * b * model.moe_shared_expert_ffn_hidden_size // tp
        if (model.moe_shared_expert_ffn_hidden_size)
        else 0
    )
    return (routed + router) / sp + shared


# ----------------------------------------------------------------------------------------------
# one rank, every phase


def in_flight(parallel: ParallelConfig, micro_batches: int, pp_rank: int) -> float:
    """Micro-batches of this stage's layers whose activations are held at once: 1 without a
    pipeline; ``min(m, PP - r)`` in 1F1B; interleaved, megatron-core's warm-up
    ``2 (PP - r - 1) + (VPP - 1) PP`` chunk passes plus one, each over 1 / VPP of the stage's
    layers (so stage 0 holds ``1 + (PP - 1) / (PP VPP)`` micro-batches' worth)."""
    pp = parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size
    if pp == 1:
        return 1.0
    if not vpp:
        return float(min(micro_batches, pp - pp_rank))
    warmup = 2 * (pp - pp_rank - 1) + (vpp - 1) * pp
    return min(micro_batches * vpp, warmup + 1) / vpp


def _largest_weight(chunks: list[list[Param]], exclude: tuple[str, ...] = ()) -> int:
    return max(
        (
            p.numel
            for chunk in chunks
            for p in chunk
            if p.trainable and not any(e in p.name for e in exclude)
        ),
        default=0,
    )


def rank_memory(
    model: ModelConfig,
    parallel: ParallelConfig,
    workload: Workload,
    numerics: Numerics,
    distributed_optimizer: bool = True,
    optimizer: str = "adam",
    lora=None,
) -> RankMemory:
    """The bytes of the rank that needs the most: every pipeline stage is estimated and the one
    with the highest peak returned.

    Raises:
        ValueError: a layout the architecture does not divide into.
    """
    stages = [
        stage_memory(model, parallel, workload, numerics, r, distributed_optimizer, optimizer, lora)
        for r in range(parallel.pipeline_model_parallel_size)
    ]
    return max(stages, key=lambda s: s.total)


def config_memory(cfg, model: ModelConfig, parallel: ParallelConfig, workload, numerics):
    """:func:`rank_memory` with the optimizer and LoRA settings of the run's config ``cfg``."""
    return rank_memory(
        model,
        parallel,
        workload,
        numerics,
        cfg.train.use_distributed_optimizer,
        cfg.train.optimizer,
        cfg.lora if cfg.lora.enabled else None,
    )


def stage_memory(
    model: ModelConfig,
    parallel: ParallelConfig,
    workload: Workload,
    numerics: Numerics,
    r: int,
    distributed_optimizer: bool = True,
    optimizer: str = "adam",
    lora=None,
) -> RankMemory:
    """The bytes of a rank of pipeline stage ``r`` (its data-parallel shard the largest)."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    sp = tp if parallel.sequence_parallel else 1
    b = numerics.bytes
    dp = parallel.data_parallel_size
    largest_weight, static = _stage_static(
        model, parallel, r, lora, numerics, distributed_optimizer, optimizer
    )
    model_bytes = static["params"] * b  # every parameter as built, before DDP's buffers
    reference = 0
    if workload.reference in ("model", "precomputed") and not workload.reference_is_base:
        reference = (
            static["params"] * b
            if lora is None
            else sum(p.numel for chunk in stage_parameters(model, parallel, r) for p in chunk) * b
        )
    resident_reference = (
        reference if workload.reference == "model" and not workload.reference_offload else 0
    )

    micro_batches = max(1, workload.global_batch_size // (workload.micro_batch_size * dp))
    tokens = workload.micro_batch_size * workload.item_tokens() / cp  # per rank, one micro-batch
    scored = workload.micro_batch_size * workload.scored_tokens() / cp
    layers = [layer for chunk in chunk_layers(model, parallel, r) for layer in chunk]
    modules = (
        tuple(model.recompute_modules or ("core_attn",))
        if (model.recompute_granularity == "selective")
        else ()
    )
    per_layer = [layer_activation_bytes(model, parallel, numerics, i, modules) for i in layers]
    checkpoint_input = b * model.hidden_size / sp
    recompute_group = 0.0
    if model.recompute_granularity == "full":
        group = model.recompute_num_layers or 1
        if model.recompute_method == "block":  # the first `group` layers of each chunk recomputed
            kept = sum(per_layer) - sum(per_layer[:group]) + group * checkpoint_input
        else:  # uniform: one checkpoint per group of layers
            kept = -(-len(layers) // group) * checkpoint_input
        recompute_group = group * max(per_layer) * tokens
        stage_activations = kept * tokens
    else:
        stage_activations = sum(per_layer) * tokens
    first, last = r == 0, r == pp - 1
    if first:
        stage_activations += 8 * tokens  # token ids kept by the embedding
    rope = _attention_shape(model, tp).rope
    if rope and numerics.host:  # the forward's one RoPE cos / sin pair (Numerics.host)
        stage_activations += 2 * b * rope * tokens
    activations = stage_activations * in_flight(parallel, micro_batches, r)

    vocab_shard = _vocab_shard(model, tp)
    logits = head_work = 0.0
    if last:
        activations += _norm_bytes(model, b) / sp * tokens  # the final norm's input
        if workload.reference != "none":
            # reference log-probs of every micro-batch of the step wait on the last stage
            rows = workload.micro_batch_size * workload.sequences_per_item
            activations += micro_batches * rows * workload.max_length * FP32
        if workload.lm_head:
            logits, head_work = lm_head_bytes(numerics, scored, model.hidden_size, vocab_shard)
    # Backward of one layer: the incoming gradient, the MLP's gradients, and a weight gradient
    # (megatron-core's local linear layers make it whole before adding it to main_grad).
    ffn = (
        (model.moe_ffn_hidden_size or model.ffn_hidden_size)
        if model.num_experts
        else (model.ffn_hidden_size)
    )
    layer_work = b * tokens * (model.hidden_size / sp + 3 * ffn / tp) + b * largest_weight
    workspace = max(layer_work, head_work) + recompute_group

    training = (
        static["weights"]
        + static["grads"]
        + static["optimizer"]
        + resident_reference
        + activations
        + logits
        + workspace
    )
    forward_only = b * tokens * (2 * model.hidden_size / sp + 3 * ffn / tp)
    if last and workload.lm_head:
        forward_only = max(
            forward_only, FP32 * _chunk_rows(numerics, scored, vocab_shard) * vocab_shard
        )
    phases = {"training": training}
    if workload.reference == "model":
        phases["reference"] = (
            static["weights"] + static["grads"] + static["optimizer"] + reference + forward_only
        )
    elif workload.reference == "precomputed":  # before DDP and the optimizer exist
        phases["reference"] = model_bytes + reference + forward_only
    # megatron-core's DDP copies each parameter into its buffer: both exist for a moment
    phases["build"] = resident_reference + model_bytes + static["weights"] + static["grads"]
    # torch's multi-tensor Adam (the CUDA default) makes one fp32 temporary per state tensor
    optimizer_temp = (
        static["optimizer"] // (3 if numerics.bf16 else 2) if optimizer == "adam" else 0
    )
    phases["optimizer"] = (
        static["weights"]
        + static["grads"]
        + static["optimizer"]
        + resident_reference
        + optimizer_temp
    )
    return RankMemory(
        pp_rank=r,
        params=static["params"],
        weights=static["weights"],
        grads=static["grads"],
        optimizer=static["optimizer"],
        reference=resident_reference,
        activations=int(activations),
        logits=int(logits),
        workspace=int(workspace),
        phases={k: int(v) for k, v in phases.items()},
    )


_STATIC_CACHE: dict = {}


def _stage_static(model, parallel, r, lora, numerics, distributed_optimizer, optimizer):
    """(parameters, :func:`static_bytes`) of stage ``r``, remembered for the layouts a search
    visits again (they differ in what does not change the parameters: micro-batch size,
    recomputation, sizes of the other dimensions)."""
    import dataclasses

    recompute = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    architecture = tuple(
        (f.name, repr(getattr(model, f.name)))
        for f in dataclasses.fields(model)
        if f.name not in recompute
    )
    p = parallel
    key = (
        architecture,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.virtual_pipeline_model_parallel_size,
        p.context_parallel_size,
        p.data_parallel_size,
        p.expert_model_parallel_size,
        p.expert_tensor_parallel(),
        r,
        None if lora is None else (lora.rank, tuple(lora.target_modules)),
        numerics.bf16,
        distributed_optimizer,
        optimizer,
    )
    if key not in _STATIC_CACHE:
        chunks = stage_parameters(model, parallel, r, lora)
        static = static_bytes(chunks, parallel, numerics, distributed_optimizer, optimizer)
        largest = _largest_weight(chunks, exclude=("word_embeddings", "output_layer"))
        _STATIC_CACHE[key] = (largest, static)
    return _STATIC_CACHE[key]


def _vocab_shard(model: ModelConfig, tp: int) -> int:
    from dpo_megatron.models.transformer_config import padded_vocab_size

    return padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp) // tp


def _chunk_rows(numerics: Numerics, scored: float, vocab_shard: int) -> float:
    chunk = FUSED_CHUNK_ELEMENTS if numerics.fused_lm_head else LOGITS_CHUNK_ELEMENTS
    return min(scored, max(1, chunk // vocab_shard))


def lm_head_bytes(
    numerics: Numerics, scored: float, hidden: int, vocab_shard: int
) -> tuple[float, float]:
    """(kept, working) bytes of the LM head on the last stage for one micro-batch's ``scored``
    positions (``models.logprobs``).

    Fused head: keeps the scored hidden states; its backward holds the fp32 weight gradient, the
    hidden states' gradient and one chunk of recomputed fp32 logits (bf16: also the chunk's
    gradient and one [V/TP, h] product in bf16). Unfused head: keeps the [scored, V/TP] logits
    (model dtype), whose gradient is written into their own memory; its backward holds an fp32
    chunk, or the output layer's weight gradient and the hidden states' gradient.
    """
    b = numerics.bytes
    rows = _chunk_rows(numerics, scored, vocab_shard)
    kept = b * scored * hidden
    if numerics.fused_lm_head:
        work = FP32 * vocab_shard * hidden + b * scored * hidden + FP32 * rows * vocab_shard
        if numerics.bf16:
            work += b * rows * vocab_shard + b * vocab_shard * hidden
        return kept, work
    kept += b * scored * vocab_shard
    work = max(FP32 * rows * vocab_shard, b * vocab_shard * hidden + b * scored * hidden)
    return kept, work
