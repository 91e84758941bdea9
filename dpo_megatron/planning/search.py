"""Every layout of a run's config on a cluster, judged by the engine's own rules, estimated and
ranked: the planner behind ``python -m dpo_megatron.plan``.

A candidate is a TP x PP x VPP x CP x EP (x expert TP) layout filling the cluster (DP takes the
rest), a micro-batch size dividing the per-replica batch, and a recompute choice (the config's,
else none and full). Each is written into a copy of the config and must pass what the launcher's
pre-check runs (``config.validate`` and megatron-core's ``TransformerConfig`` for the layout:
``models.transformer_config.build_transformer_config``), so a layout the planner offers is one
the launcher accepts; a refused one keeps the rule's message as its reason. The others are
estimated (:mod:`~dpo_megatron.planning.memory`, :mod:`~dpo_megatron.planning.step_time`) and
ranked: those that fit first, fastest first; then those that do not, smallest first.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.planning.hardware import GIB, Cluster
from dpo_megatron.planning.memory import Numerics, RankMemory, Workload, config_memory
from dpo_megatron.planning.step_time import StepTime, step_time

RECOMPUTE = {
    "none": {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}
"""Recompute choices the planner tries when the config sets none (``model.*`` keys)."""


@dataclass
class Plan:
    """One layout, judged and estimated.

    Attributes:
        parallel: the layout (``data_parallel_size`` set).
        micro_batch_size: items per micro-batch.
        recompute: 'none', 'selective' or 'full'.
        model_keys: the ``model.*`` keys the recompute choice sets.
        memory, time: the estimates (None for a refused layout).
        fits: the peak fits the device's memory (``Cluster.usable_bytes``).
        tight: it fits with less than the ranking's headroom to spare (:func:`rank`).
        reason: why it was left out or does not fit ('' when it fits).
    """

    parallel: ParallelConfig
    micro_batch_size: int
    recompute: str
    model_keys: dict = field(default_factory=dict)
    memory: RankMemory | None = None
    time: StepTime | None = None
    fits: bool = False
    tight: bool = False
    reason: str = ""
    tokens_per_step: int = 0

    @property
    def valid(self) -> bool:
        return self.memory is not None

    @property
    def status(self) -> str:
        """'yes', 'tight' (fits within the ranking's headroom), 'no' (too big) or 'refused'."""
        if not self.valid:
            return "refused"
        return "tight" if self.tight else "yes" if self.fits else "no"

    def overrides(self) -> list[str]:
        """The plan as ``key=value`` overrides of the config."""
        p = self.parallel
        keys = {
            "parallel.tensor_model_parallel_size": p.tensor_model_parallel_size,
            "parallel.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "parallel.virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
            "parallel.context_parallel_size": p.context_parallel_size,
            "parallel.data_parallel_size": p.data_parallel_size,
            "parallel.sequence_parallel": p.sequence_parallel,
        }
        if p.expert_model_parallel_size > 1:
            keys["parallel.expert_model_parallel_size"] = p.expert_model_parallel_size
            keys["parallel.expert_tensor_parallel_size"] = p.expert_tensor_parallel()
        keys["train.micro_batch_size"] = self.micro_batch_size
        keys.update({f"model.{k}": v for k, v in self.model_keys.items() if v is not None})
        return [f"{k}={_yaml(v)}" for k, v in keys.items()]

    def record(self) -> dict:
        """One JSON record (``--json``): layout, sizes, bytes, seconds, verdict."""
        p = self.parallel
        out = {
            "tp": p.tensor_model_parallel_size,
            "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size,
            "dp": p.data_parallel_size,
            "cp": p.context_parallel_size,
            "ep": p.expert_model_parallel_size,
            "etp": p.expert_tensor_parallel(),
            "sequence_parallel": p.sequence_parallel,
            "micro_batch_size": self.micro_batch_size,
            "recompute": self.recompute,
            "status": self.status,
            "fits": self.fits,
            "tight": self.tight,
            "reason": self.reason,
            "overrides": self.overrides(),
        }
        if self.memory is not None and self.time is not None:
            out.update(
                params_per_rank=self.memory.params,
                pipeline_stage=self.memory.pp_rank,
                bytes=self.memory.as_dict(),
                step_time_s=self.time.total_s,
                step_time=self.time.as_dict(),
                tokens_per_s=self.tokens_per_step / self.time.total_s,
                tokens_per_s_per_gpu=self.tokens_per_step
                / self.time.total_s
                / p.launch_world_size(),
            )
        return out


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def layouts(model: ModelConfig, cluster: Cluster, fixed: ParallelConfig | None = None):
    """Candidate layouts for ``model`` on ``cluster`` (every rank used): TP within a node,
    PP dividing the layers, VPP for PP >= 2, CP up to 8, and for MoE models EP dividing the
    experts with expert TP 1 or TP. Sequence parallelism is on whenever TP > 1 (megatron-core's
    recommendation; its MoE layer requires it). ``fixed``: only that layout."""
    world = cluster.world_size
    if fixed is not None:
        yield fixed
        return
    for tp in _powers_of_two(min(cluster.gpus_per_node, 8)):
        for cp in _powers_of_two(8):
            for pp in [p for p in range(1, model.num_layers + 1) if model.num_layers % p == 0]:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                vpps = [None] + [v for v in (2, 4) if pp > 1 and model.num_layers % (pp * v) == 0]
                eps = [1]
                if model.num_experts:
                    eps = [
                        e for e in _powers_of_two(model.num_experts) if model.num_experts % e == 0
                    ]
                for vpp in vpps:
                    for ep in eps:
                        for etp in sorted({1, tp}) if ep > 1 or model.num_experts else [None]:
                            if model.num_experts and world % ((etp or tp) * ep * pp):
                                continue
                            yield ParallelConfig(
                                tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=pp,
                                context_parallel_size=cp,
                                data_parallel_size=dp,
                                virtual_pipeline_model_parallel_size=vpp,
                                expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=etp,
                                sequence_parallel=tp > 1,
                            )


def _micro_batch_sizes(global_batch_size: int, dp: int, given: int | None) -> list[int]:
    per_replica = global_batch_size // dp if global_batch_size % dp == 0 else 0
    if given is not None:
        return [given]
    return [m for m in _powers_of_two(per_replica) if per_replica % m == 0] or [1]


def plan_layouts(
    cfg,
    model: ModelConfig,
    workload_of: Callable[[ParallelConfig, int], Workload],
    numerics: Numerics,
    cluster: Cluster,
    check: Callable[[object], None],
    fixed: ParallelConfig | None = None,
    micro_batch_size: int | None = None,
    recompute: dict | None = None,
) -> list[Plan]:
    """Judge and estimate every candidate (module docstring), ranked.

    Args:
        cfg: the run's config (a ``DPOConfig``; copied, never changed).
        model: its resolved architecture.
        workload_of: (layout, micro-batch size) -> the step's :class:`Workload`.
        numerics: dtype and kernels on the cluster's device.
        check: the engine's rules for a whole config (raises ValueError naming the conflict).
        fixed: judge only this layout (with the config's micro-batch size when given).
        micro_batch_size: only this micro-batch size.
        recompute: only these recompute choices ({name: model keys}); default the config's
            when it sets one, else :data:`RECOMPUTE`.
    """
    from dpo_megatron.models.transformer_config import build_transformer_config

    if recompute is not None:
        recomputes = recompute
    elif model.recompute_granularity is not None:
        recomputes = {model.recompute_granularity: {}}
    else:
        recomputes = RECOMPUTE
    plans: list[Plan] = []
    for parallel in layouts(model, cluster, fixed):
        dp = parallel.data_parallel_size
        for name, keys in recomputes.items():
            variant = dataclasses.replace(model, **keys)
            layout_reason = ""
            try:
                build_transformer_config(variant, parallel)
            except ValueError as e:
                layout_reason = str(e)
            for mbs in _micro_batch_sizes(cfg.train.global_batch_size, dp, micro_batch_size):
                plan = Plan(parallel, mbs, name, keys)
                plans.append(plan)
                if layout_reason:
                    plan.reason = layout_reason
                    continue
                candidate = copy.deepcopy(cfg)
                candidate.parallel = parallel
                candidate.train.micro_batch_size = mbs
                for key, value in keys.items():
                    setattr(candidate.model, key, value)
                try:
                    check(candidate)
                except ValueError as e:
                    plan.reason = str(e)
                    continue
                workload = workload_of(parallel, mbs)
                plan.memory = config_memory(cfg, variant, parallel, workload, numerics)
                plan.time = step_time(
                    variant,
                    parallel,
                    workload,
                    numerics,
                    plan.memory,
                    cluster,
                    lora=cfg.lora.enabled,
                    distributed_optimizer=cfg.train.use_distributed_optimizer,
                )
                plan.tokens_per_step = workload.global_batch_size * workload.item_tokens()
                need = plan.memory.total
                plan.fits = need <= cluster.usable_bytes
                if not plan.fits:
                    plan.reason = f"needs {need / GIB:.1f} GiB per GPU; {cluster.budget()}"
    return rank(plans, cluster.usable_bytes)


def complexity(parallel: ParallelConfig) -> tuple[int, int]:
    """How much a layout splits the dense model: model-parallel ranks (TP x PP x CP), then
    interleaving. Fewer is simpler to run and less exposed to what the estimate leaves out
    (smaller matrix products per GPU, communication that does not overlap)."""
    return (
        parallel.model_parallel_size(),
        parallel.virtual_pipeline_model_parallel_size or 1,
    )


def rank(plans: list[Plan], usable: float, tie: float = 0.02, headroom: float = 0.1) -> list[Plan]:
    """Fitting plans first, those that leave ``headroom`` of the ``usable`` bytes free before
    the tight ones (the estimate is an estimate); each group fastest first, step times within
    ``tie`` of each other counting as equal, the simpler layout (:func:`complexity`) and then
    the smaller peak first among equals. Then the estimated plans that do not fit, smallest
    first; then the refused ones."""

    def fastest(group: list[Plan]) -> list[Plan]:
        if not group:
            return group
        best = min(p.time.total_s for p in group)
        return sorted(
            group,
            key=lambda p: (
                int((p.time.total_s - best) / (tie * best)),
                complexity(p.parallel),
                p.memory.total,
            ),
        )

    for p in plans:
        p.tight = p.fits and p.memory.total > (1 - headroom) * usable
    fitting = fastest([p for p in plans if p.fits and not p.tight])
    fitting += fastest([p for p in plans if p.tight])
    too_big = sorted((p for p in plans if p.valid and not p.fits), key=lambda p: p.memory.total)
    refused = [p for p in plans if not p.valid]
    return fitting + too_big + refused
