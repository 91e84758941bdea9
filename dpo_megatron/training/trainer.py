"""The trainer: builds a run from its config once, then takes steps (torchtitan's ``Trainer``).

Set-up, in order: process groups and the device -> loss -> architecture -> data -> batch
builder, sampler and evaluator (what groups the pairs into steps) -> policy (and the frozen
reference) -> reference source (precomputed: the pairs take their reference log-probs, grouped as
the run's steps group them, and the reference model is freed) -> megatron-core DDP + optimizer +
LR schedule -> checkpointer (resume) -> logger.

``train()`` is the loop; each step is :meth:`Trainer.train_step` (sample, build, cross to the
device, reference + policy passes, optimizer update) followed by the components that own their
cadence (logger, evaluator, checkpointer). ``python -m dpo_megatron.train``,
``scripts/bench_dpo.py`` and ``scripts/gpu_bench.py`` all run this class: nothing else wires
the engine.
"""

from __future__ import annotations

import dataclasses
import math
import time

from megatron.core import parallel_state

from dpo_megatron.checkpointing.run_checkpoint import (
    Checkpointer,
    RunCounters,
    redraws_random_init,
)
from dpo_megatron.checkpointing.storage import StorageError
from dpo_megatron.data import ItemSampler
from dpo_megatron.data.batch import StepBatch
from dpo_megatron.data.builders import make_batch_builder
from dpo_megatron.data.kinds import item_kind
from dpo_megatron.generation import SamplingParams, generate
from dpo_megatron.losses import build_loss
from dpo_megatron.parallel import host_malloc, initialize_distributed, set_seed
from dpo_megatron.parallel.context import context_parallel_rank_and_size
from dpo_megatron.parallel.device import get_device
from dpo_megatron.parallel.shutdown import NonFiniteLossError, die_with_launcher
from dpo_megatron.training import run_models
from dpo_megatron.training.auto_settings import resolve_auto_settings
from dpo_megatron.training.evaluation import Evaluator, write_samples
from dpo_megatron.training.metrics_log import MetricsLogger
from dpo_megatron.training.optim import build_optimizer, current_lr, wrap_ddp
from dpo_megatron.training.reference import precomputed_pairs
from dpo_megatron.training.resolved_config import resolved_config
from dpo_megatron.training.run_data import RunData, load_run_data
from dpo_megatron.training.run_dir import RunFolder
from dpo_megatron.training.step import StepOutput, train_step
from dpo_megatron.utils import ranks


class Trainer:
    """One training run (collective: every rank builds one).

    Args:
        cfg: the run's ``DPOConfig`` (not changed: the run reads :attr:`cfg`).
        data: tokenized items to train on instead of ``cfg.data`` (tests, benchmarks); None
            loads them from the config.
        reference_weights: a checkpoint or HF folder the reference loads instead of starting
            equal to the policy (online DPO's ``online.reference=initial``); empty: the policy.

    Attributes:
        cfg: the config the run reads: ``cfg`` with the layout and the speed settings resolved
            (``training.auto_settings``), frozen (``utils.frozen``); ``config.yaml`` holds it.
        policy: this rank's DDP-wrapped policy chunks.
        reference: the reference object (``training.reference``: the frozen
            :class:`ReferenceModel`, or with LoRA the policy's base, ``BaseModelReference``), or
            None (reference-free loss, or ``reference.mode=precomputed`` after its pass).
        data: the :class:`RunData` (with ``reference.mode=precomputed`` its pairs carry their
            reference log-probs).
        counters: step and skipped-step counters (restored on resume).
        timings: set-up durations in seconds (``reference_setup_s``: the precompute pass or
            cache read of ``reference.mode=precomputed``).
    """

    def __init__(self, cfg, data: RunData | None = None, reference_weights: str = ""):
        die_with_launcher()
        initialize_distributed(cfg.parallel)
        # First: a folder in use or holding another run is refused before anything is built.
        self.run_folder = RunFolder.open(cfg)
        try:
            self._build(cfg, data, reference_weights)
        except BaseException:
            # A run that fails while it is built (a bad checkpoint to load, a layout the model
            # does not divide into) ends through its error path: its lock is released and its
            # owner record cleared, as a finished run's, so the next start finds no "run that is
            # gone" (that note is for a killed run).
            self.run_folder.close()
            raise

    def _build(self, cfg, data: RunData | None, reference_weights: str) -> None:
        """Everything of :meth:`__init__` after the run folder is opened."""
        self.layout = self.run_folder.layout
        set_seed(cfg.train.seed)
        self.device = get_device()
        self.loss_fn = build_loss(cfg.loss)
        # What the loss trains on (pairs, SFT examples or unpaired examples), chosen once: the
        # data path, the batch builder and the reports ask this kind.
        self.kind = item_kind(self.loss_fn.item_kind)
        # The loss says what the model computes (log-probs or a reward model's scores).
        model_config = run_models.with_loss_head(run_models.resolve_model_config(cfg), self.loss_fn)
        parallel, self.sequence_parallel_note = run_models.require_sequence_parallel(
            cfg.parallel, model_config
        )
        cfg = dataclasses.replace(cfg, parallel=parallel)
        self.data = (
            data
            if data is not None
            else load_run_data(cfg.data, model=model_config, kind=self.kind)
        )
        # The speed settings left at auto (packing, LM head, reference mode), before anything
        # that reads them is built: the run reads the resolved, frozen config from here on
        # (config.yaml, the start-up lines, every component); the config given is not changed.
        self.auto_settings = resolve_auto_settings(
            cfg, self.loss_fn, model_config, len(self.data.train)
        )
        self.cfg = cfg = self.auto_settings.config
        self.model_config = self.auto_settings.model_config
        self.run_folder.record_config(cfg)
        # Row lengths: the configured granule x TP, and whole 2 x CP chunks (x TP under SP).
        multiple = math.lcm(
            cfg.train.seq_length_multiple * cfg.parallel.tensor_model_parallel_size,
            cfg.parallel.sequence_granule(),
        )
        self.builder = make_batch_builder(
            cfg.packing,
            pad_token_id=self.data.pad_token_id,
            multiple=multiple,
            kind=self.kind,
            context_parallel=context_parallel_rank_and_size(),
        )
        self.batching = {
            "packing": dataclasses.asdict(cfg.packing),
            "multiple": multiple,
            "pad_token_id": self.data.pad_token_id,
        }
        """What turns micro-batches into rows besides the items (a precomputed table's key)."""
        self.sampler = self._sampler(len(self.data.train), shuffle=cfg.data.shuffle)
        self.evaluator = Evaluator(cfg.train, items=self.data.eval, builder=self.builder)
        policy = run_models.build_policy(
            self.model_config, parallel=cfg.parallel, lora=cfg.lora, seed=cfg.train.seed
        )
        reference = (
            run_models.build_reference(
                cfg.reference,
                policy=policy,
                model=self.model_config,
                parallel=cfg.parallel,
                lora=cfg.lora,
                seed=cfg.train.seed,
                weights=reference_weights,
            )
            if self.loss_fn.needs_reference
            else None
        )
        # Before DDP and the optimizer: a precomputed reference is freed before gradient buffers
        # and optimizer state exist, so the two models never coexist with them.
        started = time.perf_counter()
        self.reference = self._reference_source(reference)
        self.timings = {"reference_setup_s": time.perf_counter() - started}
        # On the CPU the policy's activations are the C heap's: its free pages go back to the OS
        # between layers (parallel.host_malloc), or a step's peak holds GiBs of freed blocks.
        self.heap_trimmer = host_malloc.trim_after_each_layer(policy, self.device)
        self.policy = wrap_ddp(policy, cfg.train.use_distributed_optimizer)
        self.optimizer, self.scheduler = build_optimizer(cfg.train, chunks=self.policy)
        saved_policy, lora_record = run_models.checkpointed_policy(
            cfg, self.model_config, self.policy
        )
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            layout=self.layout,
            states={
                "model": saved_policy,
                "optimizer": self.optimizer,
                "scheduler": self.scheduler,
                "sampler": self.sampler,
                "loss": self.loss_fn,
            },
            model_config=self.model_config,
            use_distributed_optimizer=cfg.train.use_distributed_optimizer,
            lora=lora_record,
        )
        # Resume after the reference is built: it stays the initial policy, not the checkpoint's.
        self.counters, self.resumed_from, layout_note = self.checkpointer.resume()
        self.evaluations: dict[str, tuple[int, dict[str, float]]] = {}
        """The first and the last evaluation of this process: (step, metrics)."""
        self.logger = MetricsLogger(
            cfg.logging,
            run=self.layout,
            total_steps=cfg.train.train_iters,
            start_step=self.counters.step,
            run_config=resolved_config(cfg, self.model_config, self.loss_fn),
        )
        self._report_start(layout_note)

    # ------------------------------------------------------------------------------------------
    # set-up

    def _sampler(self, num_items: int, shuffle: bool) -> ItemSampler:
        return ItemSampler(
            num_items=num_items,
            global_batch_size=self.cfg.train.global_batch_size,
            micro_batch_size=self.cfg.train.micro_batch_size,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
            seed=self.cfg.train.seed,
            shuffle=shuffle,
        )

    def _reference_source(self, reference):
        """The reference object for ``reference.mode=model``; for ``precomputed``, the train and
        eval pairs take their reference log-probs (one pass, or the cache) and the reference is
        released: no reference weights are held while training.

        The pass groups the train pairs as the first epoch's steps and the eval pairs as the
        evaluation's (``reference.micro_batch_size`` 0 or ``train.micro_batch_size``), so the
        values are those of ``reference.mode=model`` bit for bit and step-0 rewards are exactly
        0; another ``reference.micro_batch_size`` groups them by that size only."""
        if reference is None or self.cfg.reference.mode == "model":
            return reference
        from dpo_megatron.checkpointing.training_checkpoint import current_layout

        train = self.cfg.train
        layout = current_layout(train.use_distributed_optimizer)
        micro_batch_size = self.cfg.reference.micro_batch_size or train.micro_batch_size
        as_run = micro_batch_size == train.micro_batch_size
        run_steps = {
            "train": self.sampler.epoch_steps(0) if as_run else [],
            "eval": self.evaluator.steps() if as_run else [],
        }
        for split, steps in run_steps.items():
            items = getattr(self.data, split)
            setattr(
                self.data,
                split,
                precomputed_pairs(
                    self.cfg.reference,
                    reference,
                    items,
                    self.builder,
                    steps,
                    micro_batch_size,
                    self.model_config,
                    layout,
                    self.batching,
                    f"{split} {self.kind.unit}",
                ),
            )
        self.evaluator.items = self.data.eval  # now carrying their reference log-probs
        reference.release()
        return None

    def _report_start(self, layout_note: str | None) -> None:
        if not ranks.is_rank0():
            return
        cfg = self.cfg
        if self.resumed_from:
            print(
                f"resumed from {self.resumed_from} at step {self.counters.step}"
                + (f" ({layout_note})" if layout_note else ""),
                flush=True,
            )
            if (
                layout_note
                and self.loss_fn.needs_reference
                and not (cfg.model.hf_path or cfg.model.load or cfg.reference.weights())
                and redraws_random_init(self.resumed_from, cfg.train.use_distributed_optimizer)
            ):
                # Random initial weights depend on the layout (each pipeline stage draws its
                # own layers), so the reference rebuilt here is not the run's original one; a
                # data- or context-parallel change draws the same weights.
                print(
                    "WARNING: this run started from random weights and resumes at another "
                    "layout: its reference model is re-drawn at the new layout and differs "
                    "from the original. Start runs that must reshard from model.hf_path or "
                    "model.load.",
                    flush=True,
                )
        if self.sequence_parallel_note:
            print(self.sequence_parallel_note, flush=True)
        weights = run_models.weights_source(
            self.model_config,
            seed=cfg.train.seed,
            resumed_from=self.resumed_from,
            lora=cfg.lora.enabled,
        )
        reference = run_models.reference_source(cfg.reference)
        print(
            "layout "
            + cfg.parallel.describe(
                parallel_state.get_data_parallel_world_size(),
                experts=bool(self.model_config.num_experts),
            )
            + f" on {self.device} "
            # The CPU's tensors are the C allocator's (parallel.host_malloc).
            + (
                f"({host_malloc.describe(trimming=self.heap_trimmer is not None)}) "
                if self.device.type == "cpu"
                else ""
            )
            + "| "
            f"{self.loss_fn.describe()} | {len(self.data.train)} train / {len(self.data.eval)} "
            "eval "
            f"{self.kind.unit} | weights: {weights}"
            + (f" | reference: {reference}" if self.loss_fn.needs_reference and reference else ""),
            flush=True,
        )
        print(self.auto_settings.line, flush=True)
        if cfg.train.warmup_warning():
            print(cfg.train.warmup_warning(), flush=True)
        if self.loss_fn.unpaired and self.loss_fn.data_advice(self.data.train):
            print(f"WARNING: {self.loss_fn.data_advice(self.data.train)}", flush=True)

    # ------------------------------------------------------------------------------------------
    # steps

    def next_batch(self) -> StepBatch:
        """This rank's micro-batches of the next step, on the device: the sequences the loss
        reads, and those its step statistic reads in micro-batches of their own where the
        builder can split them (``BatchBuilder.computing``; asked at every step: the loss is
        the trainer's current one)."""
        indices = self.sampler.next_step()
        sides, statistic = self.loss_fn.loss_sides, self.loss_fn.statistic_sides
        builder = self.builder.computing(sides, None if statistic == sides else statistic)
        return builder.build(self.data.train, indices).to_device()

    def train_step(self) -> tuple[StepOutput, StepBatch]:
        """One optimizer step on the next batch (reference pass included); updates the counters.

        Returns:
            (the step's output, its batch).
        """
        batch = self.next_batch()
        out = train_step(
            self.policy, self.reference, self.optimizer, self.scheduler, batch, self.loss_fn
        )
        self.counters.step += 1
        if out.update_successful:
            self.counters.consecutive_skipped = 0
            self.loss_fn.on_step_end(out.metrics)
        else:
            self.counters.skipped_steps += 1
            self.counters.consecutive_skipped += 1
        return out, batch

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluation metrics (logged) and, with ``train.sample_during_eval``, greedy samples."""
        metrics = self.evaluator.run(self.policy, self.reference, self.loss_fn)
        if metrics:
            self.logger.log(step, "eval", metrics)
            self.evaluations.setdefault("first", (step, metrics))
            self.evaluations["last"] = (step, metrics)
        if self.cfg.train.sample_during_eval and self.cfg.train.eval_num_samples > 0:
            records = self.samples()
            if ranks.is_rank0() and self.logger.write_error is None:
                with self.logger.writing(self.layout.samples_file(step)):
                    path = write_samples(self.layout, step, records)
                    said = f"[eval] step {step}: {len(records)} greedy samples -> {path}"
                    print(said, flush=True)
        return metrics

    def samples(self) -> list[dict]:
        """Greedy continuations of the first ``train.eval_num_samples`` eval prompts, decoded."""
        tokenizer = self.data.tokenizer
        items = self.data.eval[: self.cfg.train.eval_num_samples]
        chosen = [x.target_ids for x in items]
        prompts = [x.prompt_ids for x in items]
        stop = {i for i in (tokenizer.eos_token_id, self.data.pad_token_id) if i is not None}
        params = SamplingParams(
            temperature=0,
            max_new_tokens=self.cfg.train.eval_sample_max_new_tokens,
            stop_ids=tuple(sorted(stop)),
        )
        outputs = [
            samples[0]
            for samples in generate(
                self.policy,
                prompts,
                params,
                micro_batch_size=self.cfg.train.micro_batch_size,
                pad_id=self.data.pad_token_id,
                vocab_size=len(tokenizer),
            )
        ]
        return [
            {
                "prompt": tokenizer.decode(list(p)),
                "sample": tokenizer.decode(o, skip_special_tokens=True),
                "chosen": tokenizer.decode(list(c), skip_special_tokens=True),
            }
            for p, o, c in zip(prompts, outputs, chosen)
        ]

    def train(self) -> dict[str, float]:
        """Run (or continue) the configured training; returns the last step's metrics.

        Raises:
            NonFiniteLossError: ``train.max_nonfinite_steps`` steps in a row had a NaN/Inf loss
                or gradient (the checkpoints written before are intact).
            StorageError: rank 0 could not write the run's logs (a full or read-only disk;
                the last checkpoint is intact), or a checkpoint could not be saved.
        """
        cfg, last = self.cfg, self.cfg.train.train_iters
        if self.counters.step >= last:
            if ranks.is_rank0():
                print(
                    f"nothing to do: {self.resumed_from} is at step {self.counters.step} >= "
                    f"train.train_iters={last}",
                    flush=True,
                )
            self.close()
            return {}
        metrics: dict[str, float] = {}
        started, first_step = time.time(), self.counters.step
        if self.counters.step == 0 and self.evaluator.due(0, last):
            self.evaluate(0)
        self._stop_if_logs_failed(self.counters.step)
        while self.counters.step < last:
            t0 = time.time()
            lr = current_lr(self.optimizer)
            out, batch = self.train_step()
            step, step_time = self.counters.step, time.time() - t0
            tokens = _sum_over_data_parallel(batch.real_tokens)
            metrics = out.metrics
            if step % cfg.train.log_interval == 0 or step == last or not out.update_successful:
                self.logger.log(
                    step,
                    "train",
                    metrics,
                    {
                        "grad_norm": out.grad_norm,
                        "lr": lr,
                        "tokens_per_s": tokens / step_time,
                        "step_time_s": step_time,
                        "seq_length": batch.seq_length,
                        "skipped_steps": self.counters.skipped_steps,
                        **_memory_over_ranks(),
                        **out.aux_metrics,
                    },
                )  # MoE load balancing: beside, not inside, the loss
            if self.counters.consecutive_skipped >= cfg.train.max_nonfinite_steps:
                self.close()
                raise NonFiniteLossError(
                    f"{self.counters.consecutive_skipped} steps in a row (up to step {step}) had "
                    f"a NaN/Inf loss or gradient (train.max_nonfinite_steps="
                    f"{cfg.train.max_nonfinite_steps}); stopping. Last checkpoint: "
                    f"{self.checkpointer.latest()}"
                )
            if self.evaluator.due(step, last):
                self.evaluate(step)
            self._stop_if_logs_failed(step)
            interrupted = self.checkpointer.after_step(self.counters, last, out.update_successful)
            if interrupted is not None:  # SIGINT / SIGTERM: saved, all ranks stop here
                self.close()
                raise interrupted
        export = self.export_final()
        if ranks.is_rank0():
            print(
                f"saved checkpoint {self.checkpointer.latest()}"
                + (
                    f" ({self.counters.skipped_steps} non-finite steps skipped)"
                    if self.counters.skipped_steps
                    else ""
                ),
                flush=True,
            )
            print(self.summary(metrics, first_step, time.time() - started, export), flush=True)
        self.close()
        return metrics

    def _stop_if_logs_failed(self, step: int) -> None:
        """Stop every rank (collective) when rank 0 could not write its logs into the run folder
        (a full or read-only disk): the run ends at its last checkpoint, from which a resume
        continues (the records past it are dropped then).

        Raises:
            StorageError: naming the file, the cause and the last checkpoint.
        """
        error = self.logger.agreed_write_error()
        if error is None:
            return
        self.close()
        latest = self.checkpointer.latest()
        kept = (
            f"the last checkpoint, {latest}, is intact: continue from it with "
            "checkpoint.resume=auto once the disk can be written"
            if latest
            else "no checkpoint was written yet"
        )
        raise StorageError(
            f"writing the run's logs failed at step {step}: {error}. Stopped there without "
            f"saving; {kept}"
        )

    def summary(
        self, metrics: dict[str, float], first_step: int, seconds: float, export: str | None
    ) -> str:
        """The end-of-run block (rank 0 prints it): what the run achieved (steps, the last
        step's loss and accuracy, the first and last evaluation) and where its files are."""
        cfg, step = self.cfg, self.counters.step
        done = step - first_step
        lines = [
            f"run summary: {done} step(s) in {seconds:.0f}s"
            + (
                f" (steps {first_step + 1}-{step} of {cfg.train.train_iters}, resumed)"
                if first_step
                else ""
            )
            + (
                f", {self.counters.skipped_steps} skipped (non-finite)"
                if self.counters.skipped_steps
                else ""
            )
            + (f"; last step: {_brief(metrics)}" if metrics else "")
        ]
        if self.evaluations:
            first, last = self.evaluations["first"], self.evaluations["last"]
            lines.append(
                "  eval: "
                + " -> ".join(
                    f"step {s} {_brief(m)} ({int(m.get('items', 0))} {self.kind.unit})"
                    for s, m in ([first, last] if first[0] != last[0] else [last])
                )
            )
        lines.append(f"  checkpoint: {self.checkpointer.latest()}")
        if export:
            lines.append(f"  export: {export}")

        logs = [self.layout.log, self.layout.metrics]
        if cfg.logging.tensorboard:
            logs.append(self.layout.tensorboard)
        lines.append(f"  logs: {', '.join(logs)}")
        return "\n".join(lines)

    def close(self) -> None:
        """Close the logs, remove the signal handlers and release the run folder."""
        self.logger.close()
        self.checkpointer.close()
        self.run_folder.close()

    def export_final(self) -> str | None:
        """Per ``checkpoint.export_hf``: the final policy as a Hugging Face folder ``<save>/hf``
        (LoRA adapters merged), or the LoRA adapters in PEFT's layout ``<save>/hf_adapter``;
        says so on rank 0. Returns what was written (a description with its folder), or None."""

        from dpo_megatron.models.conversion import export_hf, export_peft_adapter
        from dpo_megatron.models.lora_config import export_mode

        mode = export_mode(self.cfg.checkpoint.export_hf)
        chunks, dtype = [c.module for c in self.policy], self.cfg.checkpoint.export_dtype
        if mode == "adapter":
            folder = self.layout.hf_adapter
            export_peft_adapter(chunks, self.model_config, self.cfg.lora, folder, dtype)
            what = (
                f"LoRA adapter in {dtype} (PEFT: peft.PeftModel.from_pretrained(base, folder)) "
                f"-> {folder}"
            )
        elif mode == "merged":
            folder = self.layout.hf_export
            export_hf(
                chunks,
                self.model_config,
                folder,
                dtype=dtype,
                tokenizer_dir=(self.cfg.data.tokenizer or self.model_config.hf_path) or None,
                pad_token_id=self.data.pad_token_id,
            )
            what = (
                (
                    "Hugging Face reward model"
                    if self.model_config.head == "reward"
                    else "Hugging Face model"
                )
                + f" in {dtype}"
                + (" (LoRA adapters merged)" if self.cfg.lora.enabled else "")
                + f" -> {folder}"
            )
        else:
            return None
        if ranks.is_rank0():
            print(f"exported the {what}", flush=True)
        return what


def _brief(metrics: dict[str, float]) -> str:
    """``loss 0.6512, acc 0.7500, margin 0.0500`` (SFT: the loss and ``nll_loss``)."""
    keys = (
        ("loss", "loss"),
        ("nll_loss", "nll"),
        ("rewards/accuracies", "acc"),
        ("rewards/margins", "margin"),
    )
    return ", ".join(
        f"{label} {metrics[k]:.4f}"
        for k, label in keys
        if isinstance(metrics.get(k), (int, float))
        and not (k == "nll_loss" and "rewards/accuracies" in metrics)
    )


def _memory_over_ranks() -> dict[str, float]:
    """``memory/peak_gib`` and ``memory/current_gib``: the largest of any rank (device memory on
    CUDA, resident host memory on the CPU; ``parallel.device.memory_stats``)."""
    import torch
    import torch.distributed as dist

    from dpo_megatron.parallel.device import memory_stats

    stats = memory_stats()
    t = torch.tensor([stats["peak"], stats["current"]], dtype=torch.float64, device=get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    peak, current = t.tolist()
    return {"memory/peak_gib": peak, "memory/current_gib": current}


def _sum_over_data_parallel(value: float) -> float:
    """Sum of a per-rank count over the data-parallel ranks (each DP rank counted its tokens
    once per TP x PP copy)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=get_device())
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return float(t.item())


__all__ = ["NonFiniteLossError", "RunCounters", "Trainer"]
