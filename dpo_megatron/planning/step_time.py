"""How long one optimizer step takes on a layout: model FLOPs at a stated MFU, the pipeline
bubble, and the communication the layout adds, none of it overlapped (the engine runs
megatron-core's DDP without overlapped reduction and its layers without communication overlap).

* **Compute**: the step's FLOPs (:mod:`dpo_megatron.planning.flops`) over all ranks: the policy's
  forward and backward (3 forwards; 2 with LoRA, whose frozen weights get no weight gradient),
  the reference's forward when it runs each step, one more policy forward for a step statistic
  (beta-DPO) or for full recomputation, at ``mfu`` x the dense peak.
* **Bubble**: 1F1B idles each stage for (PP - 1) / (VPP m) of the compute (Narayanan et al.
  2021, sec. 2.2), m the micro-batches per data-parallel rank.
* **Tensor parallel**: per layer and micro-batch two all-reduces (or all-gather + reduce-scatter
  under sequence parallelism, the same volume) of the [tokens, hidden] activations in forward and
  two in backward; a ring all-reduce moves 2 (t - 1) / t of the bytes (Patarasuk & Yuan 2009).
* **Context parallel**: each layer all-gathers keys and values over the CP group (the engine's
  ``models.context_attention``) and reduce-scatters their gradients.
* **Expert parallel**: each MoE layer's all-to-all dispatch and combine, forward and backward.
* **Data parallel**: the gradient reduce-scatter (fp32) and the parameter all-gather of the
  distributed optimizer, or one all-reduce without it.
* **Pipeline**: each micro-batch's activations and gradients between stages.
* **Optimizer**: a memory-bound pass over the weights, gradients and optimizer state.
* **Experts**: megatron-core's ``SequentialMLP`` runs a rank's experts one after another from
  Python, a fixed host cost per expert and pass (``Cluster.expert_overhead_us``): what makes
  expert parallelism pay beyond its memory.

Groups take the bandwidth of where their ranks sit (:meth:`Cluster.link_gbps`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.planning.flops import item_forward_flops, layer_flops_per_token
from dpo_megatron.planning.hardware import Cluster
from dpo_megatron.planning.memory import Numerics, RankMemory, Workload


@dataclass
class StepTime:
    """Seconds of one optimizer step, by cause (``total_s`` their sum)."""

    compute_s: float
    bubble_s: float
    tensor_parallel_s: float
    context_parallel_s: float
    expert_parallel_s: float
    data_parallel_s: float
    pipeline_s: float
    optimizer_s: float
    experts_s: float
    model_flops: float
    """Model FLOPs of the step over all ranks (recomputation not counted)."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.bubble_s
            + self.tensor_parallel_s
            + self.context_parallel_s
            + self.expert_parallel_s
            + self.data_parallel_s
            + self.pipeline_s
            + self.optimizer_s
            + self.experts_s
        )

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}


def _ring(bytes_: float, ranks: int, gbps: float, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather / reduce-scatter (x 2 for an all-reduce) of ``bytes_``."""
    if ranks <= 1:
        return 0.0
    factor = 2.0 if all_reduce else 1.0
    return factor * (ranks - 1) / ranks * bytes_ / (gbps * 1e9)


def step_time(
    model: ModelConfig,
    parallel: ParallelConfig,
    workload: Workload,
    numerics: Numerics,
    memory: RankMemory,
    cluster: Cluster,
    lora: bool = False,
    distributed_optimizer: bool = True,
) -> StepTime:
    """Estimate one step (see the module docstring).

    Args:
        memory: the rank's bytes (:func:`~dpo_megatron.planning.memory.rank_memory`): its
            gradient and parameter buffers set the data-parallel volume.
    """
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    ep = parallel.expert_model_parallel_size
    dp = parallel.data_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    b = numerics.bytes
    h = model.hidden_size
    prompt = workload.prompt_tokens()
    completions = [workload.max_length - prompt] * workload.sequences_per_item
    forward = item_forward_flops(
        layer_flops_per_token(model),
        model.num_layers,
        h,
        model.vocab_size if workload.lm_head else None,
        prompt,
        completions,
        workload.share_prompt,
    )
    policy = 2.0 if lora else 3.0
    model_passes = policy + (1.0 if workload.reference == "model" else 0.0)
    model_passes += 1.0 if workload.policy_statistic_pass else 0.0
    recompute = 1.0 if model.recompute_granularity == "full" else 0.0
    model_flops = workload.global_batch_size * forward * model_passes
    peak = cluster.accelerator.bf16_tflops * 1e12 * cluster.mfu
    compute = workload.global_batch_size * forward * (model_passes + recompute)
    compute /= cluster.world_size * peak
    micro_batches = max(1, workload.global_batch_size // (workload.micro_batch_size * dp))
    bubble = compute * (pp - 1) / (vpp * micro_batches)

    tokens = workload.micro_batch_size * workload.item_tokens() / cp  # per rank and micro-batch
    layers = model.num_layers / pp
    # forward + backward of the policy (4 collectives), forward of the reference (2)
    collectives = 4 + (2 if workload.reference == "model" else 0)
    activation = tokens * h * b
    tp_time = (
        micro_batches
        * layers
        * collectives
        * _ring(activation, tp, cluster.link_gbps(tp), all_reduce=True)
    )
    kv = model.num_query_groups or model.num_attention_heads
    d = model.kv_channels or h // model.num_attention_heads
    kv_bytes = tokens * 2 * kv * d / tp * b * cp  # the gathered keys and values of one layer
    cp_passes = 2 + (1 if workload.reference == "model" else 0)
    cp_time = micro_batches * layers * cp_passes * _ring(kv_bytes, cp, cluster.link_gbps(tp * cp))
    ep_time = experts_time = 0.0
    if model.num_experts:
        moe_layers = (model.num_layers - model.moe_first_dense_layers) / pp
        passes = 3 + (1 if workload.reference == "model" else 0)  # forward, backward (x 2)
        experts_time = (
            micro_batches
            * moe_layers
            * passes
            * (model.num_experts / ep)
            * cluster.expert_overhead_us
            * 1e-6
        )
    if model.num_experts and ep > 1:
        moe_layers = (model.num_layers - model.moe_first_dense_layers) / pp
        routed = tokens / (tp if parallel.sequence_parallel else 1) * model.moe_router_topk * h * b
        passes = 4 + (2 if workload.reference == "model" else 0)
        link = cluster.link_gbps(tp * cp * ep)
        ep_time = micro_batches * moe_layers * passes * (ep - 1) / ep * routed / (link * 1e9)
    dp_link = cluster.link_gbps(tp * cp * dp)
    grads = memory.grads
    params_bytes = grads // 4 * b
    if distributed_optimizer:
        dp_time = _ring(grads, dp * cp, dp_link) + _ring(params_bytes, dp * cp, dp_link)
    else:
        dp_time = _ring(grads, dp * cp, dp_link, all_reduce=True)
    pp_time = 0.0
    if pp > 1:
        pp_link = cluster.link_gbps(cluster.world_size)
        pp_time = micro_batches * vpp * 2 * activation / (pp_link * 1e9)
    optimizer = 3 * (memory.weights + memory.grads + memory.optimizer)
    optimizer_time = optimizer / (cluster.accelerator.memory_gbps * 1e9)
    return StepTime(
        compute_s=compute,
        bubble_s=bubble,
        tensor_parallel_s=tp_time,
        context_parallel_s=cp_time,
        expert_parallel_s=ep_time,
        data_parallel_s=dp_time,
        pipeline_s=pp_time,
        optimizer_s=optimizer_time,
        experts_s=experts_time,
        model_flops=model_flops,
    )
