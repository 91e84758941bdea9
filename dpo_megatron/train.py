"""Train a policy with a DPO-family loss: ``python -m dpo_megatron.train --config FILE [k=v ...]``.

Runs under torchrun (one process per rank) or as a single process (world size 1). The flow:
config -> process groups -> loss -> policy and frozen reference (same layout, same weights) ->
data -> megatron-core DDP + optimizer -> steps (log, evaluate, checkpoint) -> final checkpoint.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

# megatron-core warns at import about every missing GPU extra; on CPU that is expected.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE).*not installed.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

from megatron.core import parallel_state  # noqa: E402

from dpo_megatron.config import DPOConfig, load_config, parse_args  # noqa: E402
from dpo_megatron.data import PairSampler, load_preference_pairs, load_tokenizer  # noqa: E402
from dpo_megatron.losses import build_loss  # noqa: E402
from dpo_megatron.models import ModelConfig, build_model_chunks  # noqa: E402
from dpo_megatron.parallel import destroy_distributed, initialize_distributed, set_seed  # noqa
from dpo_megatron.training.batches import build_micro_batches, build_step_batches  # noqa: E402
from dpo_megatron.training.metrics_log import MetricsLogger, is_logging_rank  # noqa: E402
from dpo_megatron.training.optim import (  # noqa: E402
    build_optimizer,
    copy_weights,
    current_lr,
    freeze,
    wrap_ddp,
)
from dpo_megatron.training.reference import build_reference_source  # noqa: E402
from dpo_megatron.training.step import dpo_forward_backward, train_step  # noqa: E402


@dataclass
class Models:
    """The models of a run: policy chunks (DDP after set-up) and the frozen reference, or None."""

    config: ModelConfig
    policy: list
    reference: Optional[list]


def resolve_model_config(cfg: DPOConfig) -> ModelConfig:
    """The architecture: derived from ``model.hf_path``'s config.json when given."""
    if cfg.model.hf_path:
        from dpo_megatron.models.conversion import model_config_from_hf

        return model_config_from_hf(cfg.model.hf_path, cfg.model)
    return cfg.model


def build_models(cfg: DPOConfig, model_cfg: ModelConfig, needs_reference: bool) -> Models:
    """Policy (weights from model.load, else model.hf_path, else random) and its frozen copy.

    The reference is built with the same function and layout and copied from the policy before
    training, so each pipeline stage holds its layers of both and step 0 has policy == reference.
    """
    policy = build_model_chunks(model_cfg, cfg.parallel)
    if cfg.model.load:
        from dpo_megatron.checkpointing import load_model_checkpoint

        load_model_checkpoint(policy, cfg.model.load)
    elif model_cfg.hf_path:
        from dpo_megatron.models.conversion import load_hf_weights

        load_hf_weights(policy, model_cfg, model_cfg.hf_path)
    reference = None
    if needs_reference:
        reference = freeze(build_model_chunks(model_cfg, cfg.parallel))
        copy_weights(policy, reference)
    return Models(model_cfg, policy, reference)


def _load_data(cfg: DPOConfig, model_cfg: ModelConfig):
    """Tokenizer + tokenized pairs; rank 0 first so the others hit its cache."""
    tokenizer = load_tokenizer(cfg.data.tokenizer or model_cfg.hf_path)
    if dist.get_rank() != 0:
        dist.barrier()
    dataset = load_preference_pairs(cfg.data, tokenizer)
    if dist.get_rank() == 0:
        dist.barrier()
    if not dataset.train:
        raise ValueError(f"no training pairs left in {cfg.data.path or cfg.data.datasets} "
                         f"after filtering: {dataset.summary}")
    return tokenizer, dataset


def _sampler(cfg: DPOConfig, num_pairs: int, shuffle: bool) -> PairSampler:
    return PairSampler(
        num_pairs=num_pairs,
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        seed=cfg.train.seed,
        shuffle=shuffle,
    )


def _global_sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return float(t.item())


def evaluate(cfg: DPOConfig, models: Models, loss_fn, pairs, pad_id: int) -> dict[str, float]:
    """Forward-only pass over the eval split (or ``train.eval_iters`` batches); pair-weighted
    means of the loss metrics."""
    sampler = _sampler(cfg, len(pairs), shuffle=False)
    steps = len(pairs) // cfg.train.global_batch_size
    if cfg.train.eval_iters:
        steps = min(steps, cfg.train.eval_iters)
    totals: dict[str, float] = {}
    count = 0
    for _ in range(steps):
        mbs, seq_length, _ = build_micro_batches(pairs, sampler.next_step(), pad_id, _multiple(cfg))
        out = dpo_forward_backward(models.policy, models.reference, mbs, seq_length, loss_fn,
                                   forward_only=True)
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0.0) + v * out.num_pairs
        count += out.num_pairs
    return {k: v / count for k, v in totals.items()} if count else {}


def _multiple(cfg: DPOConfig) -> int:
    return cfg.train.seq_length_multiple * cfg.parallel.tensor_model_parallel_size


def save_final(cfg: DPOConfig, models: Models, tokenizer_dir: str) -> str:
    """Write the policy's distributed checkpoint (and an HF export when asked); returns its dir."""
    from dpo_megatron.checkpointing import save_model_checkpoint

    save_dir = cfg.checkpoint.save or os.path.join(cfg.run_dir, "checkpoints")
    final = os.path.join(save_dir, f"iter_{cfg.train.train_iters:07d}")
    chunks = [c.module for c in models.policy]
    save_model_checkpoint(chunks, final)
    if cfg.checkpoint.export_hf:
        from dpo_megatron.models.conversion import export_hf

        export_hf(chunks, models.config, os.path.join(save_dir, "hf"),
                  dtype=cfg.checkpoint.export_dtype, tokenizer_dir=tokenizer_dir or None)
    return final


def train(cfg: DPOConfig) -> dict[str, float]:
    """Run the configured training; returns the last step's metrics."""
    initialize_distributed(cfg.parallel)
    set_seed(cfg.train.seed)
    loss_fn = build_loss(cfg.loss)
    model_cfg = resolve_model_config(cfg)
    tokenizer, dataset = _load_data(cfg, model_cfg)
    models = build_models(cfg, model_cfg, loss_fn.needs_reference)
    models.policy = wrap_ddp(models.policy, cfg.train.use_distributed_optimizer)
    optimizer, scheduler = build_optimizer(models.policy, cfg.train)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id
    sampler = _sampler(cfg, len(dataset.train), shuffle=True)
    # Reference log-probs per step: the frozen model, or a table precomputed once (issue 7).
    reference = build_reference_source(
        cfg.reference, models.reference, dataset.train, pad_id, _multiple(cfg),
        cfg.train.micro_batch_size, model_cfg, cfg.train.seed, cfg.packing.enabled) \
        if loss_fn.needs_reference else None
    logger = MetricsLogger(cfg.run_dir, cfg.train.train_iters)
    if is_logging_rank():
        print(f"layout TP {cfg.parallel.tensor_model_parallel_size} x PP "
              f"{cfg.parallel.pipeline_model_parallel_size} x DP "
              f"{parallel_state.get_data_parallel_world_size()} | loss {cfg.loss} | "
              f"{len(dataset.train)} train / {len(dataset.eval)} eval pairs", flush=True)
    metrics: dict[str, float] = {}
    for step in range(1, cfg.train.train_iters + 1):
        t0 = time.time()
        mbs, seq_length, tokens, indices = build_step_batches(
            dataset.train, sampler.next_step(), pad_id, _multiple(cfg), cfg.packing)
        if reference is not None:
            reference.attach(mbs, indices, seq_length)
        lr = current_lr(optimizer)
        out = train_step(models.policy, models.reference, optimizer, scheduler, mbs, seq_length,
                         loss_fn, reference_attached=reference is not None)
        loss_fn.on_step_end(out.metrics)
        step_time = time.time() - t0
        # Each DP rank counted its tokens once per TP x PP copy: sum over DP only.
        tokens = _global_sum(tokens)
        metrics = out.metrics
        if step % cfg.train.log_interval == 0 or step == cfg.train.train_iters:
            logger.log(step, "train", metrics, {
                "grad_norm": out.grad_norm, "lr": lr, "tokens_per_s": tokens / step_time,
                "step_time_s": step_time, "seq_length": seq_length})
        if dataset.eval and cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            logger.log(step, "eval", evaluate(cfg, models, loss_fn, dataset.eval, pad_id))
    if dataset.eval:
        logger.log(cfg.train.train_iters, "eval",
                   evaluate(cfg, models, loss_fn, dataset.eval, pad_id))
    final = save_final(cfg, models, cfg.data.tokenizer or model_cfg.hf_path)
    if is_logging_rank():
        print(f"saved checkpoint {final}", flush=True)
    logger.close()
    return metrics


def main(argv: Optional[Sequence[str]] = None) -> None:
    config_file, overrides = parse_args(argv)
    cfg = load_config(config_file, overrides)
    try:
        train(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
