"""Train a policy with a DPO-family loss: ``python -m dpo_megatron.train --config FILE [k=v ...]``.

Runs under torchrun (one process per rank) or as a single process (world size 1). The flow:
config -> process groups -> loss -> policy and frozen reference (same layout, same weights) ->
data -> megatron-core DDP + optimizer -> steps (log, evaluate, checkpoint) -> final checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dpo_megatron.runtime_warnings import filter_expected_warnings  # noqa: E402

filter_expected_warnings()  # before megatron-core's import-time warnings

from megatron.core import parallel_state  # noqa: E402

from dpo_megatron.checkpointing.training_checkpoint import (  # noqa: E402
    find_latest_checkpoint,
    resolve_resume,
)
from dpo_megatron.config import DPOConfig, load_config, parse_args  # noqa: E402
from dpo_megatron.data import (  # noqa: E402
    PairSampler,
    load_preference_pairs,
    load_sft_examples,
    load_tokenizer,
)
from dpo_megatron.losses import build_loss  # noqa: E402
from dpo_megatron.models import ModelConfig, build_model_chunks  # noqa: E402
from dpo_megatron.parallel import destroy_distributed, initialize_distributed, set_seed  # noqa
from dpo_megatron.training.batches import build_step_batches  # noqa: E402
from dpo_megatron.training.evaluation import (  # noqa: E402
    evaluate,
    greedy_generate,
    write_samples,
)
from dpo_megatron.training.metrics_log import MetricsLogger, is_logging_rank  # noqa: E402
from dpo_megatron.training.optim import (  # noqa: E402
    build_optimizer,
    copy_weights,
    current_lr,
    freeze,
    wrap_ddp,
)
from dpo_megatron.training.reference import build_reference_source  # noqa: E402
from dpo_megatron.training.run_checkpoint import (  # noqa: E402
    RunCounters,
    layout_note,
    resume_run,
    save_run,
)
from dpo_megatron.training.sft import build_sft_micro_batches  # noqa: E402
from dpo_megatron.training.step import train_step  # noqa: E402


class NonFiniteLossError(RuntimeError):
    """Too many steps in a row had a NaN/Inf loss or gradient (``train.max_nonfinite_steps``)."""


@dataclass
class Models:
    """The models of a run: policy chunks (DDP after set-up) and the frozen reference, or None."""

    config: ModelConfig
    policy: list
    reference: Optional[list]


def resolve_model_config(cfg: DPOConfig) -> ModelConfig:
    """The architecture: derived from ``model.hf_path``'s config.json when given, else the one
    stored with the ``model.load`` checkpoint, else the ``model.*`` fields."""
    if cfg.model.hf_path:
        from dpo_megatron.models.conversion import model_config_from_hf

        return model_config_from_hf(cfg.model.hf_path, cfg.model)
    if cfg.model.load:
        from dpo_megatron.checkpointing import load_model_config

        stored = load_model_config(resolve_model_load(cfg.model.load))
        if stored is not None:
            stored.load = cfg.model.load
            return stored
    return cfg.model


def resolve_model_load(path: str) -> str:
    """``model.load`` as a checkpoint folder: itself, or the latest checkpoint inside it (a run's
    ``checkpoints`` folder)."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    return find_latest_checkpoint(path) or path


def build_models(cfg: DPOConfig, model_cfg: ModelConfig, needs_reference: bool) -> Models:
    """Policy (weights from model.load, else model.hf_path, else random) and its frozen copy.

    The reference is built with the same function and layout and copied from the policy before
    training, so each pipeline stage holds its layers of both and step 0 has policy == reference.
    """
    policy = build_model_chunks(model_cfg, cfg.parallel)
    if cfg.model.load:
        from dpo_megatron.checkpointing import load_model_checkpoint

        load_model_checkpoint(policy, resolve_model_load(cfg.model.load))
    elif model_cfg.hf_path:
        from dpo_megatron.models.conversion import load_hf_weights

        load_hf_weights(policy, model_cfg, model_cfg.hf_path)
    reference = None
    if needs_reference:
        reference = freeze(build_model_chunks(model_cfg, cfg.parallel))
        copy_weights(policy, reference)
    return Models(model_cfg, policy, reference)


def check_vocab_fits(tokenizer, model_cfg: ModelConfig) -> None:
    """A token id past the embedding table would fail deep inside the first forward.

    Raises:
        ValueError: the tokenizer has more ids than ``model.vocab_size``.
    """
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    if size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer has {size} ids but model.vocab_size is "
                         f"{model_cfg.vocab_size}: set model.vocab_size >= {size}")


def _load_data(cfg: DPOConfig, model_cfg: ModelConfig, sft: bool = False):
    """Tokenizer + tokenized pairs (SFT examples for a loss that reads no rejected completion);
    rank 0 first so the others hit its cache."""
    tokenizer = load_tokenizer(cfg.data.tokenizer or model_cfg.hf_path)
    check_vocab_fits(tokenizer, model_cfg)
    load = load_sft_examples if sft else load_preference_pairs
    # Rank 0 first (the others then hit its cache); its failure must reach every rank, or they
    # would wait in a collective until the timeout.
    failure, dataset = None, None
    if dist.get_rank() == 0:
        try:
            dataset = load(cfg.data, tokenizer)
        except Exception as e:  # re-raised below, after telling the other ranks
            failure = e
    ok = torch.tensor([0 if failure else 1])
    dist.broadcast(ok, src=0)
    if failure is not None:
        raise failure
    if not ok.item():
        raise RuntimeError("rank 0 failed to load the data; its error is above")
    if dataset is None:
        dataset = load(cfg.data, tokenizer)
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


def _step_batches(cfg: DPOConfig, items, micro_batch_indices, pad_id: int, sft: bool):
    """(micro_batches, seq_length, real_tokens, micro_batch_indices) of one step: chosen-only
    rows for SFT, else pairs (padded or packed)."""
    if sft:
        return (*build_sft_micro_batches(items, micro_batch_indices, pad_id, _multiple(cfg)),
                micro_batch_indices)
    return build_step_batches(items, micro_batch_indices, pad_id, _multiple(cfg), cfg.packing)


def run_evaluation(cfg: DPOConfig, models: Models, loss_fn, items, pad_id: int,
                   sft: bool) -> dict[str, float]:
    """Forward-only pass over the eval split (or ``train.eval_iters`` batches, in order) in
    whole global batches; {} when the split is smaller than one."""
    steps = len(items) // cfg.train.global_batch_size
    if steps == 0:
        return {}
    sampler = _sampler(cfg, len(items), shuffle=False)
    if cfg.train.eval_iters:
        steps = min(steps, cfg.train.eval_iters)
    batches = (_step_batches(cfg, items, sampler.next_step(), pad_id, sft)[:2]
               for _ in range(steps))
    return evaluate(models.policy, models.reference, loss_fn, batches)


def eval_samples(cfg: DPOConfig, models: Models, tokenizer, items, pad_id: int) -> list[dict]:
    """Greedy continuations of the first ``train.eval_num_samples`` eval prompts, decoded."""
    chosen = [getattr(x, "chosen_ids", None) or x.completion_ids
              for x in items[:cfg.train.eval_num_samples]]
    prompts = [x.prompt_ids for x in items[:cfg.train.eval_num_samples]]
    stop = {i for i in (tokenizer.eos_token_id, pad_id) if i is not None}
    outputs = greedy_generate(models.policy, prompts, cfg.train.eval_sample_max_new_tokens, stop,
                              pad_id, _multiple(cfg), vocab_size=len(tokenizer))
    return [{"prompt": tokenizer.decode(list(p)),
             "sample": tokenizer.decode(o, skip_special_tokens=True),
             "chosen": tokenizer.decode(list(c), skip_special_tokens=True)}
            for p, o, c in zip(prompts, outputs, chosen)]


def _evaluate_and_log(cfg: DPOConfig, models: Models, loss_fn, tokenizer, items, pad_id: int,
                      sft: bool, step: int, logger: MetricsLogger) -> None:
    metrics = run_evaluation(cfg, models, loss_fn, items, pad_id, sft)
    if metrics:
        logger.log(step, "eval", metrics)
    elif is_logging_rank():
        print(f"[eval] step {step}: {len(items)} eval items < train.global_batch_size="
              f"{cfg.train.global_batch_size}: no eval metrics", flush=True)
    if cfg.train.sample_during_eval and cfg.train.eval_num_samples > 0:
        records = eval_samples(cfg, models, tokenizer, items, pad_id)
        if is_logging_rank():
            path = write_samples(cfg.run_dir, step, records)
            print(f"[eval] step {step}: {len(records)} greedy samples -> {path}", flush=True)


def _multiple(cfg: DPOConfig) -> int:
    return cfg.train.seq_length_multiple * cfg.parallel.tensor_model_parallel_size


def _save_dir(cfg: DPOConfig) -> str:
    return cfg.checkpoint.save or os.path.join(cfg.run_dir, "checkpoints")


def save_checkpoint(cfg: DPOConfig, models: Models, optimizer, scheduler, sampler, loss_fn,
                    counters: RunCounters) -> str:
    """Training checkpoint of the current step (model, optimizer, scheduler, RNG, data position,
    loss state, counters); returns its folder. Also loadable as ``model.load`` weights."""
    return save_run(_save_dir(cfg), models.policy, optimizer, scheduler, sampler, loss_fn,
                    counters, cfg.train.use_distributed_optimizer, cfg.checkpoint.keep_last_n,
                    models.config)


def export_final(cfg: DPOConfig, models: Models, tokenizer_dir: str) -> None:
    """The final policy as a Hugging Face folder ``<save>/hf`` when ``checkpoint.export_hf``."""
    if cfg.checkpoint.export_hf:
        from dpo_megatron.models.conversion import export_hf

        export_hf([c.module for c in models.policy], models.config,
                  os.path.join(_save_dir(cfg), "hf"), dtype=cfg.checkpoint.export_dtype,
                  tokenizer_dir=tokenizer_dir or None)


def _update_counters(counters: RunCounters, step: int, update_successful: bool) -> None:
    counters.step = step
    if update_successful:
        counters.consecutive_skipped = 0
    else:
        counters.skipped_steps += 1
        counters.consecutive_skipped += 1


def train(cfg: DPOConfig) -> dict[str, float]:
    """Run the configured training, or continue it (``checkpoint.resume``); returns the last
    step's metrics.

    Raises:
        NonFiniteLossError: ``train.max_nonfinite_steps`` steps in a row had a NaN/Inf loss or
            gradient (the checkpoints written before are intact).
    """
    initialize_distributed(cfg.parallel)
    set_seed(cfg.train.seed)
    loss_fn = build_loss(cfg.loss)
    # A loss that reads no rejected completion (sft) trains on prompt + chosen rows only.
    sft = not loss_fn.needs_rejected
    if sft and cfg.packing.enabled:
        raise ValueError(f"packing.enabled=true packs preference pairs; loss {cfg.loss['name']} "
                         "trains on single completions: set packing.enabled=false")
    model_cfg = resolve_model_config(cfg)
    tokenizer, dataset = _load_data(cfg, model_cfg, sft)
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
    # Resume after the reference is built: it stays the initial policy, not the checkpoint's.
    counters = RunCounters()
    resume_from = resolve_resume(cfg.checkpoint.resume, _save_dir(cfg))
    if resume_from:
        note = layout_note(resume_from, cfg.train.use_distributed_optimizer)
        counters = resume_run(resume_from, models.policy, optimizer, scheduler, sampler, loss_fn,
                              cfg.train.use_distributed_optimizer)
        if is_logging_rank():
            print(f"resumed from {resume_from} at step {counters.step}"
                  + (f" ({note})" if note else ""), flush=True)
            if note and reference is not None and not (cfg.model.hf_path or cfg.model.load):
                # Random initial weights depend on the layout (each pipeline stage draws its
                # own layers), so the reference rebuilt here is not the run's original one.
                print("WARNING: this run started from random weights and resumes at another "
                      "layout: its reference model is re-drawn at the new layout and differs "
                      "from the original. Start runs that must reshard from model.hf_path or "
                      "model.load.", flush=True)
    logger = MetricsLogger(cfg.run_dir, cfg.train.train_iters, cfg.logging,
                           start_step=counters.step, run_config=_plain(cfg))
    if is_logging_rank():
        print(f"layout TP {cfg.parallel.tensor_model_parallel_size} x PP "
              f"{cfg.parallel.pipeline_model_parallel_size} x DP "
              f"{parallel_state.get_data_parallel_world_size()} | {loss_fn!r} | "
              f"{len(dataset.train)} train / {len(dataset.eval)} eval "
              f"{'examples' if sft else 'pairs'}", flush=True)
    if counters.step >= cfg.train.train_iters:
        if is_logging_rank():
            print(f"nothing to do: {resume_from} is at step {counters.step} >= "
                  f"train.train_iters={cfg.train.train_iters}", flush=True)
        logger.close()
        return {}
    metrics: dict[str, float] = {}
    saved_step = counters.step if resume_from else -1
    evaluated_step = -1
    for step in range(counters.step + 1, cfg.train.train_iters + 1):
        t0 = time.time()
        mbs, seq_length, tokens, indices = _step_batches(
            cfg, dataset.train, sampler.next_step(), pad_id, sft)
        if reference is not None:
            reference.attach(mbs, indices, seq_length)
        lr = current_lr(optimizer)
        out = train_step(models.policy, models.reference, optimizer, scheduler, mbs, seq_length,
                         loss_fn, reference_attached=reference is not None)
        _update_counters(counters, step, out.update_successful)
        if out.update_successful:
            loss_fn.on_step_end(out.metrics)
        step_time = time.time() - t0
        # Each DP rank counted its tokens once per TP x PP copy: sum over DP only.
        tokens = _global_sum(tokens)
        metrics = out.metrics
        if (step % cfg.train.log_interval == 0 or step == cfg.train.train_iters
                or not out.update_successful):
            logger.log(step, "train", metrics, {
                "grad_norm": out.grad_norm, "lr": lr, "tokens_per_s": tokens / step_time,
                "step_time_s": step_time, "seq_length": seq_length,
                "skipped_steps": counters.skipped_steps})
        if counters.consecutive_skipped >= cfg.train.max_nonfinite_steps:
            logger.close()
            raise NonFiniteLossError(
                f"{counters.consecutive_skipped} steps in a row (up to step {step}) had a NaN/Inf "
                f"loss or gradient (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); "
                f"stopping. Last checkpoint: {find_latest_checkpoint(_save_dir(cfg))}")
        if dataset.eval and cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            _evaluate_and_log(cfg, models, loss_fn, tokenizer, dataset.eval, pad_id, sft, step,
                              logger)
            evaluated_step = step
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            save_checkpoint(cfg, models, optimizer, scheduler, sampler, loss_fn, counters)
            saved_step = step
    if dataset.eval and evaluated_step != cfg.train.train_iters:
        _evaluate_and_log(cfg, models, loss_fn, tokenizer, dataset.eval, pad_id, sft,
                          cfg.train.train_iters, logger)
    final = os.path.join(_save_dir(cfg), f"iter_{cfg.train.train_iters:07d}")
    if saved_step != cfg.train.train_iters:
        final = save_checkpoint(cfg, models, optimizer, scheduler, sampler, loss_fn, counters)
    export_final(cfg, models, cfg.data.tokenizer or model_cfg.hf_path)
    if is_logging_rank():
        print(f"saved checkpoint {final}"
              + (f" ({counters.skipped_steps} non-finite steps skipped)"
                 if counters.skipped_steps else ""), flush=True)
    logger.close()
    return metrics


def _plain(cfg: DPOConfig) -> dict:
    """The config as plain containers (for W&B)."""
    from dataclasses import asdict

    return asdict(cfg)


def main(argv: Optional[Sequence[str]] = None) -> None:
    config_file, overrides = parse_args(argv)
    try:
        cfg = load_config(config_file, overrides)
    except ValueError as e:  # a config mistake: the message is the whole story
        raise SystemExit(f"config error: {e}") from None
    try:
        train(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
