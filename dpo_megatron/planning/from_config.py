"""A run's config read the way the planner needs it: the step's work, the numerics on the
target device, the layout of the config itself, and one call that estimates a config as it
stands (the launcher's memory warning)."""

from __future__ import annotations

import copy

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.planning.hardware import GIB, Cluster
from dpo_megatron.planning.memory import Numerics, Workload, config_memory


def resolved_model(cfg, loss_fn) -> ModelConfig:
    """The architecture the run trains (``model.hf_path``'s config.json, a preset's stored one,
    a ``model.load`` checkpoint's, or the ``model.*`` keys) with the loss's head."""
    from dpo_megatron.training.run_models import resolve_model_config, with_loss_head

    return with_loss_head(resolve_model_config(cfg), loss_fn)


def numerics_for(model: ModelConfig, cluster: Cluster) -> Numerics:
    """The dtype and kernels of ``model`` on the cluster's device: ``params_dtype=auto`` is bf16
    on an accelerator and fp32 on the host; ``fused_lm_head`` unset is fused on an accelerator
    and unfused on the host (``models.gpt.lm_head_is_fused``); CUDA's fp32 attention kernels
    take keys repeated to every head."""
    bf16 = model.params_dtype == "bfloat16" if model.params_dtype != "auto" else not cluster.host
    fused = model.fused_lm_head if model.fused_lm_head is not None else not cluster.host
    return Numerics(
        bf16=bf16, fused_lm_head=fused, expand_kv=not bf16 and not cluster.host, host=cluster.host
    )


def workload_for(
    cfg,
    loss_fn,
    model: ModelConfig,
    micro_batch_size: int,
    prompt_fraction: float | None = None,
    train_items: int | None = None,
) -> Workload:
    """The step's work for ``cfg`` (its batch sizes, lengths, loss, packing and reference) at
    ``micro_batch_size``.

    Args:
        prompt_fraction: the prompt's share of a sequence (default: ``data.max_prompt_length /
            data.max_length``, prompts as long as allowed).
        train_items: items in the training data, to resolve ``reference.mode=auto`` as the run
            would (``training.auto_settings``); None: as if the steps covered them all.
    """
    from dpo_megatron.training.auto_settings import resolve_packing, resolve_reference

    packing, _ = resolve_packing(cfg, loss_fn, model)
    items = (
        train_items
        if train_items is not None
        else cfg.train.train_iters * cfg.train.global_batch_size
    )
    resolved_reference, _ = resolve_reference(cfg, loss_fn, items)
    reference = resolved_reference.mode if loss_fn.needs_reference else "none"
    data = cfg.data
    fraction = (
        prompt_fraction
        if prompt_fraction is not None
        else min(data.max_prompt_length, data.max_length - 1) / data.max_length
    )
    sequences = 1 if loss_fn.item_kind == "sft" else 2
    return Workload(
        max_length=data.max_length,
        prompt_fraction=fraction,
        sequences_per_item=sequences,
        share_prompt=bool(packing.enabled and packing.share_prompt),
        lm_head=loss_fn.model_head == "lm",
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=micro_batch_size,
        reference=reference,
        reference_is_base=cfg.lora.enabled,
        reference_offload=cfg.reference.offload,
        policy_statistic_pass=loss_fn.needs_step_statistic(True),
    )


def config_layout(cfg, model: ModelConfig, world_size: int) -> ParallelConfig:
    """The config's own layout on ``world_size`` ranks, with its data-parallel size:
    ``parallel.data_parallel_size``, or what ``world_size`` leaves; MoE models at TP > 1 get
    sequence parallelism, as the ranks turn it on
    (``training.run_models.require_sequence_parallel``).

    Raises:
        ValueError: the layout does not fit ``world_size`` ranks (the ranks' own message:
            ``ParallelConfig.validate``).
    """
    from dpo_megatron.models.moe import moe_needs_sequence_parallel

    parallel = copy.deepcopy(cfg.parallel)
    parallel.validate(world_size)
    if parallel.data_parallel_size is None:
        parallel.data_parallel_size = world_size // parallel.model_parallel_size()
    if moe_needs_sequence_parallel(model, parallel.tensor_model_parallel_size):
        parallel.sequence_parallel = True
    return parallel


def local_cluster(ranks: int) -> Cluster | None:
    """The cluster a CUDA launch of ``ranks`` ranks runs on, as this machine's first GPU sees it
    (its name, or its memory and the H100's peak when the name is not in the table); None
    without CUDA."""
    import dataclasses

    import torch

    from dpo_megatron.planning.hardware import find_accelerator

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    memory = torch.cuda.get_device_properties(0).total_memory / GIB
    known = find_accelerator(name) or find_accelerator("h100")
    accelerator = dataclasses.replace(
        known, memory_gib=memory, sku=known.sku if find_accelerator(name) else name
    )
    return Cluster(1, ranks, accelerator)


def memory_warning(cfg, loss_fn, model: ModelConfig, cluster: Cluster) -> str | None:
    """One line when the planner's peak for ``cfg``'s own layout exceeds the device's memory,
    else None (an estimate: the launcher warns, it does not refuse)."""
    parallel = config_layout(cfg, model, cluster.world_size)
    workload = workload_for(cfg, loss_fn, model, cfg.train.micro_batch_size)
    numerics = numerics_for(model, cluster)
    memory = config_memory(cfg, model, parallel, workload, numerics)
    if memory.total <= cluster.usable_bytes:
        return None
    return (
        f"WARNING: the layout planner predicts {memory.total / GIB:.1f} GiB per GPU for this "
        f"layout (pipeline stage {memory.pp_rank}), but {cluster.budget()}: the run may run out "
        "of memory; scripts/pretrain_dpo.sh --plan with this config lists layouts that fit"
    )
