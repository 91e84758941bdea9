"""What a training checkpoint holds for the loop, and when it is written and read back.

``checkpointing.training_checkpoint`` stores tensors (model, optimizer), RNG and a JSON train
state; this module decides what goes into that train state (step, the run's id, LR scheduler,
data position, loss state, skipped-step counters, layout) and restores it into the loop's
objects, so a run of 2N steps and a run of N steps resumed for N more take the same steps with
the same numbers. :class:`Checkpointer` owns the cadence:

* **when**: every ``checkpoint.save_interval`` steps, at the end, and when a SIGINT / SIGTERM
  reached any rank (:mod:`~dpo_megatron.parallel.shutdown`; all ranks stop at the same step);
  never after a step whose update was skipped (NaN/Inf: its weights are the previous step's,
  and a checkpoint there would let a resume skip the evidence), and never before the first
  applied update (megatron-core cannot save an optimizer that has no state yet);
* **what it resumes**: ``checkpoint.resume=auto`` takes the newest checkpoint that passes
  verification (checksums, no pickled code); the ones it skips are named with the reason and
  renamed ``iter_N.corrupt``. An explicit checkpoint that fails is an error naming the files;
* **what it prunes**: only checkpoints carrying this run's id (a run id is drawn at a fresh
  start and carried over by every resume), so a run never deletes another run's checkpoints.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import asdict, dataclass

from dpo_megatron.checkpointing.integrity import CheckpointIntegrityError, verify_checkpoint
from dpo_megatron.checkpointing.training_checkpoint import (
    checkpoint_name,
    current_layout,
    find_latest_checkpoint,
    load_training_checkpoint,
    prune_checkpoints,
    read_train_state,
    remove_stale_tmp,
    resume_candidates,
    save_training_checkpoint,
    saved_layout,
)
from dpo_megatron.parallel.shutdown import RunInterrupted, StopRequest
from dpo_megatron.utils import ranks
from dpo_megatron.utils.run_layout import RunLayout


@dataclass
class RunCounters:
    """The loop's own state besides models, optimizer and data position."""

    step: int = 0
    """Optimizer steps taken (skipped non-finite steps included)."""
    skipped_steps: int = 0
    """Steps skipped for a NaN/Inf loss or gradient, in total."""
    consecutive_skipped: int = 0
    """Skipped steps in a row up to now (0 after a good step)."""

    @property
    def applied_updates(self) -> int:
        """Optimizer updates actually applied (steps minus skipped steps)."""
        return self.step - self.skipped_steps


def new_run_id() -> str:
    """A fresh run id: start time and 24 random bits, ``20250101-120000-a1b2c3``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


STATE_ENTRIES = ("scheduler", "sampler", "loss")
"""The stateful objects whose ``state_dict()`` the JSON train state holds, under these names
(beside the tensors of ``model`` and ``optimizer``): :func:`save_run` writes each and
:func:`resume_run` gives each back its ``load_state_dict()``."""


def save_run(
    save_dir: str,
    states: dict,
    counters: RunCounters,
    *,
    use_distributed_optimizer: bool,
    keep_last_n: int,
    model_cfg=None,
    lora: dict | None = None,
    run_id: str | None = None,
) -> str:
    """Save a training checkpoint for ``counters.step`` under ``save_dir`` (collective; rank 0
    prints the save's report: size, seconds, seconds of the checksums), then delete this run's
    checkpoints beyond the newest ``keep_last_n``. ``states``: the run's stateful objects by
    name (:class:`Checkpointer`). ``lora``: the run's LoRA record, stored as
    ``train_state["lora"]`` (the ``model`` chunks then hold adapters only). Returns the folder.

    Raises:
        CheckpointSaveError: the save failed (disk full, read-only, ...): nothing was pruned.
    """
    ckpt_dir = os.path.join(save_dir, checkpoint_name(counters.step))
    train_state = {
        "step": counters.step,
        "run_id": run_id,
        "counters": asdict(counters),
        **{name: states[name].state_dict() for name in STATE_ENTRIES},
        "layout": current_layout(use_distributed_optimizer),
    }
    if lora is not None:
        train_state["lora"] = lora
    report = save_training_checkpoint(
        ckpt_dir, states["model"], states["optimizer"], train_state, model_cfg
    )
    if ranks.is_rank0():
        print(report, flush=True)
        prune_checkpoints(save_dir, keep_last_n, run_id)
    ranks.barrier()
    return ckpt_dir


def resume_run(
    ckpt_dir: str, states: dict, *, use_distributed_optimizer: bool, verified: bool = False
) -> tuple[RunCounters, dict]:
    """Load a checkpoint written by :func:`save_run` into the run's stateful objects
    (``states``, by name; collective).

    The LR schedule continues as saved (megatron-core's behaviour); configured values that
    differ (e.g. a longer ``train_iters``) are reported on rank 0 and ignored.

    Returns:
        (the counters, the checkpoint's train state).

    Raises:
        CheckpointIntegrityError: a file failed verification (unless ``verified``).
        ValueError: the checkpoint's data order, loss state or optimizer format does not match
            this run's configuration (the message names the setting), or it holds no state of
            an entry of :data:`STATE_ENTRIES`.
    """
    state = load_training_checkpoint(
        ckpt_dir,
        states["model"],
        states["optimizer"],
        use_distributed_optimizer,
        verified=verified,
    )
    scheduler = states["scheduler"]
    changed = schedule_changes(scheduler.state_dict(), state["scheduler"])
    if changed and ranks.is_rank0():
        # megatron-core's scheduler keeps the checkpoint's schedule (use_checkpoint_opt_param_
        # scheduler): say so, rather than let a longer train_iters silently keep the old decay.
        print(
            f"note: {ckpt_dir} continues its own LR schedule; the config's differs in "
            f"{changed} (ignored)",
            flush=True,
        )
    scheduler.load_state_dict(state["scheduler"])
    try:
        for name in STATE_ENTRIES:  # every entry save_run wrote, the scheduler's read above
            if name == "scheduler":
                continue
            if name not in state:
                raise ValueError(f"train_state.json holds no {name!r} state")
            states[name].load_state_dict(state[name])
    except ValueError as e:
        raise ValueError(f"{ckpt_dir}: {e}") from None
    return RunCounters(**state["counters"]), state


def schedule_changes(configured: dict, saved: dict) -> dict:
    """Scheduler settings (not the step count) whose configured value differs from the saved
    one: name -> (saved, configured)."""
    return {
        k: (saved[k], v)
        for k, v in configured.items()
        if k != "num_steps" and k in saved and saved[k] != v
    }


RANDOM_INIT_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)
"""The layout sizes a random initialisation depends on: each pipeline stage (and model chunk)
draws its own layers, and on a GPU each tensor- or expert-parallel rank its own shard. Data and
context parallelism replicate the same weights."""


def redraws_random_init(ckpt_dir: str, use_distributed_optimizer: bool) -> bool:
    """Whether this run's layout draws another random initialisation than the one
    ``ckpt_dir`` was saved at (a size of :data:`RANDOM_INIT_LAYOUT` changed)."""
    saved = saved_layout(read_train_state(ckpt_dir))
    now = current_layout(use_distributed_optimizer)
    return any(saved.get(k) != now.get(k) for k in RANDOM_INIT_LAYOUT)


def layout_note(ckpt_dir: str, use_distributed_optimizer: bool) -> str | None:
    """A line saying the checkpoint was saved at another layout (resharded on load), or None."""
    saved = saved_layout(read_train_state(ckpt_dir))
    now = current_layout(use_distributed_optimizer)
    if saved == now:
        return None
    changed = ", ".join(f"{k} {saved.get(k)} -> {now[k]}" for k in now if saved.get(k) != now[k])
    return f"resharding {ckpt_dir} ({changed}); RNG states start fresh"


def check_lora_record(ckpt_dir: str, lora: dict | None) -> str | None:
    """Whether the checkpoint's model state fits this run: both full, or both LoRA with the
    same adapters (rank, alpha, dropout, targets). Returns a note when the base weights' source
    differs (the adapters are then applied to another base), else None.

    Raises:
        ValueError: a LoRA checkpoint for a full run or the reverse, or other adapters.
    """
    from dpo_megatron.checkpointing.training_checkpoint import read_train_state

    saved = read_train_state(ckpt_dir).get("lora")
    if (saved is None) != (lora is None):
        what = "LoRA adapters (no base weights)" if saved else "a full model"
        raise ValueError(
            f"{ckpt_dir} holds {what}, but this run has lora.enabled="
            f"{lora is not None}: resume with the setting it was saved with"
        )
    if saved is None:
        return None
    differ = {k: (saved.get(k), v) for k, v in lora.items() if k != "base" and saved.get(k) != v}
    if differ:
        raise ValueError(
            f"{ckpt_dir} holds other LoRA adapters: {differ} (saved, configured); "
            "resume with the lora.* settings it was saved with"
        )
    if saved.get("base") != lora["base"]:
        return (
            f"its adapters were trained on {saved.get('base')}, this run's base is {lora['base']}"
        )
    return None


def _say(message: str) -> None:
    if ranks.is_rank0():
        print(message, flush=True)


class Checkpointer:
    """A run's checkpoints: where (``checkpoint.save`` or ``<run_dir>/checkpoints``), when
    (every ``checkpoint.save_interval`` steps, at the end, on SIGINT / SIGTERM), how many
    (``keep_last_n`` of this run's) and of what (the stateful objects given here, once).

    Building it installs the SIGINT / SIGTERM handlers (:class:`~dpo_megatron.parallel.shutdown.
    StopRequest`); :meth:`close` removes them.

    Args:
        cfg: the ``checkpoint`` config section.
        layout: the run folder's layout (the checkpoint folder is its ``checkpoints``).
        states: what a checkpoint saves and a resume restores, by name (torchtitan's
            ``CheckpointManager`` states): ``model`` (this rank's policy chunks, or with LoRA
            the adapters' view of them), ``optimizer``, and the objects of
            :data:`STATE_ENTRIES` (``scheduler``, ``sampler``, ``loss``: ``state_dict()`` /
            ``load_state_dict()``).
        model_config: stored as ``model_config.json`` beside the tensors.
        use_distributed_optimizer: ``train.use_distributed_optimizer``.
        lora: the run's LoRA record (``run_models.checkpointed_policy``), None for a full run.
    """

    def __init__(
        self,
        cfg,
        *,
        layout: RunLayout,
        states: dict,
        model_config,
        use_distributed_optimizer: bool,
        lora: dict | None = None,
    ):
        missing = {"model", "optimizer", *STATE_ENTRIES} - set(states)
        if missing:
            raise ValueError(f"Checkpointer: no {', '.join(sorted(missing))} in its states")
        self.cfg = cfg
        self.save_dir = layout.checkpoints
        self.states = dict(states)
        self.model_config = model_config
        self.use_distributed_optimizer = use_distributed_optimizer
        self.lora = lora
        self.last_saved_step: int | None = None
        self.run_id: str | None = None
        self.stop = StopRequest()

    # ------------------------------------------------------------------------------------------
    # resume

    def resume(self) -> tuple[RunCounters, str | None, str | None]:
        """Restore the checkpoint ``checkpoint.resume`` names (collective); with ``auto``, the
        newest one that verifies (skipped ones are named, with why, and renamed
        ``iter_N.corrupt``).

        Returns:
            (counters, the checkpoint folder or None for a fresh start, a note when it was saved
            at another layout or None).

        Raises:
            CheckpointIntegrityError: an explicit checkpoint fails verification, or with
                ``auto`` none of the run's checkpoints does.
        """
        if ranks.is_rank0():
            for path in remove_stale_tmp(self.save_dir):
                print(f"note: removed {path}, left by a save that did not finish", flush=True)
        candidates = resume_candidates(self.cfg.resume, self.save_dir)
        skipped: list[tuple[str, list[str]]] = []
        for path in candidates:
            verification = verify_checkpoint(path)
            if verification.problems:
                if self.cfg.resume != "auto":
                    verification.raise_if_failed(path)
                skipped.append((path, verification.problems))
                continue
            self._report_skipped(skipped)
            _say(verification.report(path))
            note = layout_note(path, self.use_distributed_optimizer)
            base_note = check_lora_record(path, self.lora)
            if base_note:
                _say(f"WARNING: resuming {path}: {base_note}")
            counters, state = resume_run(
                path,
                self.states,
                use_distributed_optimizer=self.use_distributed_optimizer,
                verified=True,
            )
            self.last_saved_step = counters.step
            self.run_id = state.get("run_id") or ranks.broadcast_from_rank0(new_run_id())
            return counters, path, note
        if skipped:
            raise CheckpointIntegrityError(
                self.save_dir,
                [f"{os.path.basename(p)}: {'; '.join(problems)}" for p, problems in skipped]
                + [
                    "no checkpoint verifies: move the folder aside or delete the bad checkpoints "
                    "to start afresh (checkpoint.resume=none checkpoint.overwrite=true)"
                ],
            )
        if self.cfg.resume == "auto":
            _say(
                f"no checkpoint: starting fresh (checkpoint.resume=auto found none in "
                f"{self.save_dir})"
            )
        self.run_id = ranks.broadcast_from_rank0(new_run_id())
        return RunCounters(), None, None

    def _report_skipped(self, skipped: list[tuple[str, list[str]]]) -> None:
        """Warn about the checkpoints ``auto`` passed over and rename them ``iter_N.corrupt``,
        so that they neither count as the latest nor get pruned in place of good ones."""
        for path, problems in skipped:
            if ranks.is_rank0():
                moved = f"{path}.corrupt"
                try:
                    os.rename(path, moved)
                except OSError:
                    moved = path
                print(
                    f"WARNING: skipped checkpoint {path}: {'; '.join(problems)} (moved to {moved})",
                    flush=True,
                )
        if skipped:
            ranks.barrier()

    # ------------------------------------------------------------------------------------------
    # save

    def due(self, step: int, last_step: int) -> bool:
        """Whether to save after ``step``: every ``save_interval`` steps, and after the last
        (unless that step is already saved)."""
        if step == self.last_saved_step:
            return False
        return step == last_step or bool(
            self.cfg.save_interval and step % self.cfg.save_interval == 0
        )

    def after_step(
        self, counters: RunCounters, last_step: int, update_successful: bool
    ) -> RunInterrupted | None:
        """The step boundary (collective): save when due or when a rank was signalled, unless
        the step's update was skipped. A signal that arrives during a save stops the run after
        it (the ranks agree again once it is written). Returns the :class:`RunInterrupted` to
        raise when the run must stop (the caller closes its components first), else None."""
        signum = self.stop.agreed()
        step = counters.step
        saved = False
        if (signum or self.due(step, last_step)) and step != self.last_saved_step:
            if update_successful:
                saved = self.save(counters) is not None
                signum = signum or self.stop.agreed()
            else:
                _say(
                    f"step {step}: its update was skipped (non-finite loss or gradient): no "
                    f"checkpoint written (last checkpoint: {self.latest()})"
                )
        if not signum:
            return None
        interrupted = RunInterrupted(
            signum, step, self.latest(), saved or step == self.last_saved_step
        )
        _say(str(interrupted))
        return interrupted

    def save(self, counters: RunCounters) -> str | None:
        """Save the current step (collective); returns the checkpoint folder, or None (with a
        message) when no update has been applied yet: megatron-core cannot save an optimizer
        without state, and such a checkpoint would hold the initial weights only."""
        if counters.applied_updates <= 0:
            _say(
                f"step {counters.step}: no optimizer update applied yet (every step so far was "
                f"skipped): nothing to checkpoint"
            )
            return None
        path = save_run(
            self.save_dir,
            self.states,
            counters,
            use_distributed_optimizer=self.use_distributed_optimizer,
            keep_last_n=self.cfg.keep_last_n,
            model_cfg=self.model_config,
            lora=self.lora,
            run_id=self.run_id,
        )
        self.last_saved_step = counters.step
        return path

    def latest(self) -> str | None:
        """The newest complete checkpoint of the save folder, or None."""
        return find_latest_checkpoint(self.save_dir)

    def close(self) -> None:
        """Remove the signal handlers."""
        self.stop.close()
