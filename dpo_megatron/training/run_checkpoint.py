"""What a training checkpoint holds for the loop, and putting it back.

``checkpointing.training_checkpoint`` stores tensors (model, optimizer), RNG and a JSON train
state; this module decides what goes into that train state (step, LR scheduler, data position,
loss state, skipped-step counters, layout) and restores it into the loop's objects, so a run of
2N steps and a run of N steps resumed for N more take the same steps with the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

import torch.distributed as dist

from dpo_megatron.checkpointing.training_checkpoint import (
    checkpoint_name,
    current_layout,
    load_training_checkpoint,
    prune_checkpoints,
    save_training_checkpoint,
)


@dataclass
class RunCounters:
    """The loop's own state besides models, optimizer and data position."""

    step: int = 0
    """Optimizer steps taken (skipped non-finite steps included)."""
    skipped_steps: int = 0
    """Steps skipped for a NaN/Inf loss or gradient, in total."""
    consecutive_skipped: int = 0
    """Skipped steps in a row up to now (0 after a good step)."""


def save_run(save_dir: str, chunks: list, optimizer, scheduler, sampler, loss_fn,
             counters: RunCounters, use_distributed_optimizer: bool, keep_last_n: int,
             model_cfg=None, lora: Optional[dict] = None) -> str:
    """Save a training checkpoint for ``counters.step`` under ``save_dir`` (collective), then
    delete checkpoints beyond the newest ``keep_last_n``. ``lora``: the run's LoRA record,
    stored as ``train_state["lora"]`` (its ``chunks`` then hold adapters only). Returns the
    checkpoint folder."""
    ckpt_dir = os.path.join(save_dir, checkpoint_name(counters.step))
    train_state = {
        "step": counters.step,
        "counters": asdict(counters),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "loss": loss_fn.state_dict(),
        "layout": current_layout(use_distributed_optimizer),
    }
    if lora is not None:
        train_state["lora"] = lora
    save_training_checkpoint(ckpt_dir, chunks, optimizer, train_state, model_cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        prune_checkpoints(save_dir, keep_last_n)
    if dist.is_initialized():
        dist.barrier()
    return ckpt_dir


def resume_run(ckpt_dir: str, chunks: list, optimizer, scheduler, sampler, loss_fn,
               use_distributed_optimizer: bool) -> RunCounters:
    """Load a checkpoint written by :func:`save_run` into the loop's objects (collective).

    The LR schedule continues as saved (megatron-core's behaviour); configured values that
    differ (e.g. a longer ``train_iters``) are reported on rank 0 and ignored.

    Raises:
        ValueError: the checkpoint's data order, loss state or optimizer format does not match
            this run's configuration (the message names the setting).
    """
    state = load_training_checkpoint(ckpt_dir, chunks, optimizer, use_distributed_optimizer)
    changed = schedule_changes(scheduler.state_dict(), state["scheduler"])
    if changed and (not dist.is_initialized() or dist.get_rank() == 0):
        # megatron-core's scheduler keeps the checkpoint's schedule (use_checkpoint_opt_param_
        # scheduler): say so, rather than let a longer train_iters silently keep the old decay.
        print(f"note: {ckpt_dir} continues its own LR schedule; the config's differs in "
              f"{changed} (ignored)", flush=True)
    scheduler.load_state_dict(state["scheduler"])
    try:
        sampler.load_state_dict(state["sampler"])
        loss_fn.load_state_dict(state["loss"])
    except ValueError as e:
        raise ValueError(f"{ckpt_dir}: {e}") from None
    return RunCounters(**state["counters"])


def schedule_changes(configured: dict, saved: dict) -> dict:
    """Scheduler settings (not the step count) whose configured value differs from the saved
    one: name -> (saved, configured)."""
    return {k: (saved[k], v) for k, v in configured.items()
            if k != "num_steps" and k in saved and saved[k] != v}


def layout_note(ckpt_dir: str, use_distributed_optimizer: bool) -> Optional[str]:
    """A line saying the checkpoint was saved at another layout (resharded on load), or None."""
    from dpo_megatron.checkpointing.training_checkpoint import read_train_state

    saved = read_train_state(ckpt_dir)["layout"]
    now = current_layout(use_distributed_optimizer)
    if saved == now:
        return None
    changed = ", ".join(f"{k} {saved.get(k)} -> {now[k]}" for k in now if saved.get(k) != now[k])
    return f"resharding {ckpt_dir} ({changed}); RNG states start fresh"


def check_lora_record(ckpt_dir: str, lora: Optional[dict]) -> Optional[str]:
    """Whether the checkpoint's model state fits this run: both full, or both LoRA with the
    same adapters (rank, alpha, dropout, targets). Returns a note when the base weights' source
    differs (the adapters are then applied to another base), else None.

    Raises:
        ValueError: a LoRA checkpoint for a full run or the reverse, or other adapters.
    """
    from dpo_megatron.checkpointing.training_checkpoint import read_train_state

    saved = read_train_state(ckpt_dir).get("lora")
    if (saved is None) != (lora is None):
        what = ("LoRA adapters (no base weights)" if saved else "a full model")
        raise ValueError(f"{ckpt_dir} holds {what}, but this run has lora.enabled="
                         f"{lora is not None}: resume with the setting it was saved with")
    if saved is None:
        return None
    differ = {k: (saved.get(k), v) for k, v in lora.items() if k != "base" and saved.get(k) != v}
    if differ:
        raise ValueError(f"{ckpt_dir} holds other LoRA adapters: {differ} (saved, configured); "
                         "resume with the lora.* settings it was saved with")
    if saved.get("base") != lora["base"]:
        return f"its adapters were trained on {saved.get('base')}, this run's base is {lora['base']}"
    return None


class Checkpointer:
    """A run's checkpoints: where (``checkpoint.save`` or ``<run_dir>/checkpoints``), when
    (every ``checkpoint.save_interval`` steps and at the end), how many (``keep_last_n``) and of
    what (the stateful objects given here, once).

    Args:
        cfg: the ``checkpoint`` config section.
        run_dir: the run's folder.
        policy, optimizer, scheduler, sampler, loss_fn: the objects a checkpoint saves and a
            resume restores.
        model_config: stored as ``model_config.json`` beside the tensors.
        use_distributed_optimizer: ``train.use_distributed_optimizer``.
        lora: the run's LoRA record (``model_setup.checkpointed_policy``), None for a full run.
    """

    def __init__(self, cfg, run_dir: str, policy: list, optimizer, scheduler, sampler, loss_fn,
                 model_config, use_distributed_optimizer: bool, lora: Optional[dict] = None):
        self.cfg = cfg
        self.save_dir = cfg.save or os.path.join(run_dir, "checkpoints")
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.sampler, self.loss_fn = sampler, loss_fn
        self.model_config = model_config
        self.use_distributed_optimizer = use_distributed_optimizer
        self.lora = lora
        self.last_saved_step: Optional[int] = None

    def resume(self) -> tuple[RunCounters, Optional[str], Optional[str]]:
        """Restore the checkpoint ``checkpoint.resume`` names (collective).

        Returns:
            (counters, the checkpoint folder or None for a fresh start, a note when it was saved
            at another layout or None).
        """
        from dpo_megatron.checkpointing.training_checkpoint import resolve_resume

        resume_from = resolve_resume(self.cfg.resume, self.save_dir)
        if not resume_from:
            return RunCounters(), None, None
        note = layout_note(resume_from, self.use_distributed_optimizer)
        base_note = check_lora_record(resume_from, self.lora)
        if base_note and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"WARNING: resuming {resume_from}: {base_note}", flush=True)
        counters = resume_run(resume_from, self.policy, self.optimizer, self.scheduler,
                              self.sampler, self.loss_fn, self.use_distributed_optimizer)
        self.last_saved_step = counters.step
        return counters, resume_from, note

    def due(self, step: int, last_step: int) -> bool:
        """Whether to save after ``step``: every ``save_interval`` steps, and after the last
        (unless that step is already saved)."""
        if step == self.last_saved_step:
            return False
        return step == last_step or bool(self.cfg.save_interval
                                         and step % self.cfg.save_interval == 0)

    def save(self, counters: RunCounters) -> str:
        """Save the current step (collective); returns the checkpoint folder."""
        path = save_run(self.save_dir, self.policy, self.optimizer, self.scheduler, self.sampler,
                        self.loss_fn, counters, self.use_distributed_optimizer,
                        self.cfg.keep_last_n, self.model_config, self.lora)
        self.last_saved_step = counters.step
        return path

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint of the save folder, or None."""
        from dpo_megatron.checkpointing.training_checkpoint import find_latest_checkpoint

        return find_latest_checkpoint(self.save_dir)
