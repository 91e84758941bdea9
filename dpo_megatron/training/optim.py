"""megatron-core DDP, (distributed) optimizer and LR scheduler for the policy."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import (
    OptimizerConfig,
    ParamGroupOverride,
    ParamKey,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dpo_megatron.models.reward_head import HEAD_PARAMETER
from dpo_megatron.parallel.device import get_device
from dpo_megatron.training.config import TrainConfig


def wrap_ddp(chunks: list, use_distributed_optimizer: bool) -> list[DistributedDataParallel]:
    """Wrap each policy chunk in megatron-core DDP (fp32 grad buffers, synchronous reduce).

    Also installs ``finalize_model_grads`` as the schedule's end-of-backward hook: it finishes
    the DP reduction, all-reduces tied-embedding and sequence-parallel norm gradients, and
    divides by the global pair count (``calculate_per_token_loss``).
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Bucketing only matters for overlap; later chunks keep it off like megatron's
                # train.
                disable_bucketing=i > 0,
            )
        )
    wrapped[0].config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(train: TrainConfig, *, chunks: list[DistributedDataParallel]):
    """megatron-core optimizer + OptimizerParamScheduler stepping once per optimizer step, from
    the ``train`` config section over the DDP-wrapped ``chunks``.

    Returns:
        (optimizer, scheduler). Without apex / transformer-engine megatron-core falls back to
        torch's Adam (decoupled weight decay, i.e. AdamW).
    """
    model_config = chunks[0].config
    config = OptimizerConfig(
        optimizer=train.optimizer,
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=model_config.bf16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=train.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, chunks, param_group_overrides(config, train))
    fuse_torch_adam_on_cpu(optimizer, get_device())
    if model_config.bf16 or model_config.fp16:
        model_config.grad_scale_func = optimizer.scale_loss
    decay_iters = train.lr_decay_iters or train.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if train.lr_warmup_iters else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, train.lr_warmup_iters + 1),
        lr_decay_style=train.lr_decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=max(decay_iters, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def fuse_torch_adam_on_cpu(optimizer, device: torch.device) -> int:
    """Give megatron-core's torch Adam(W) torch's fused kernel when the run's ``device`` is the
    CPU; returns how many parameter groups were switched.

    Without apex / transformer-engine megatron-core builds torch's Adam with torch's defaults,
    and torch's default on the CPU is its per-parameter Python loop (its multi-tensor path is for
    CUDA), several times slower than the fused CPU kernel (``torch._fused_adamw_``, torch >= 2.4;
    measured: docs/BENCHMARKS.md). The update is
    Adam's (Kingma & Ba 2015, Algorithm 1; decoupled weight decay, Loshchilov & Hutter 2019) in
    another order of operations: values agree to rounding. Set before the first step, when
    torch's Adam makes its state (the fused kernel wants its ``step`` counters on the
    parameters' device, which lazy creation then does). CUDA keeps torch's default.

    Every group is switched, an empty one too: with the distributed optimizer a data-parallel
    rank's share of a group (the norms' and biases' no-decay group of a small model) can be
    empty, and a group left as built would make the ranks' optimizer settings differ (the
    common state a checkpoint stores once, from rank 0). The decision is the run's device, the
    same on every rank, not the parameters a rank happens to hold.
    """
    if device.type != "cpu":
        return 0
    switched = 0
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam) or inner.state:
            continue
        for group in inner.param_groups:
            if not group["fused"]:
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def param_group_overrides(config: OptimizerConfig, train: TrainConfig) -> dict:
    """megatron-core's standard parameter groups (no weight decay on biases and norms), plus
    ``train.reward_head_lr`` as the peak learning rate of a reward model's head (a parameter
    named ``*reward_head.weight``; its group follows the same schedule to its own peak)."""
    overrides = get_standard_config_overrides(config)
    if train.reward_head_lr is not None:
        head = ParamKey(name=f"*{HEAD_PARAMETER}")
        overrides[head] = ParamGroupOverride(max_lr=train.reward_head_lr)
    return overrides


def current_lr(optimizer) -> float:
    """Learning rate of the first parameter group (the body's: a reward head with its own
    ``train.reward_head_lr`` is in a later group)."""
    return float(optimizer.param_groups[0]["lr"])


def freeze(chunks: list) -> list:
    """Make model chunks a frozen reference: eval mode, no gradients."""
    for chunk in chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)
    return chunks


def copy_weights(src_chunks: list, dst_chunks: list) -> None:
    """Copy weights chunk by chunk (same layout): the reference starts equal to the policy."""
    with torch.no_grad():
        for src, dst in zip(src_chunks, dst_chunks):
            dst.load_state_dict(src.state_dict(), strict=True)
