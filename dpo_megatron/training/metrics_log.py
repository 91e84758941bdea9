"""Step logs on rank 0: a progress line, TensorBoard scalars, optional W&B, and metrics.jsonl.

Metric names follow TRL (``rewards/chosen``, ``rewards/margins``, ``logps/chosen`` ...): rewards
are beta-scaled policy-vs-reference log-ratios in nats, logps are summed completion log-probs.

``metrics.jsonl`` is strict JSON (RFC 8259), one object per line: a non-finite value (a skipped
NaN/Inf step's loss or grad norm) is written as the *string* ``"NaN"``, ``"Infinity"`` or
``"-Infinity"`` (Python's ``float()`` reads each back), never as the bare ``NaN`` token that
strict parsers reject. A resumed run appends to the same file after dropping the records of
steps past its checkpoint (those the interrupted run logged but did not save), so the file
reads as one run; a torn last line (the process killed mid-write) is dropped with a warning, and
the file is rewritten atomically (a temporary file renamed over it).

A write that fails (a full or read-only disk) does not raise where it happens, on rank 0 alone
while the other ranks wait in a collective: the logger keeps the first failure, stops writing
files, and :meth:`MetricsLogger.agreed_write_error` gives it to every rank at the step
boundary, where the trainer stops the run (``checkpointing.storage.StorageError``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from collections.abc import Iterator

from dpo_megatron.training.config import LoggingConfig  # noqa: F401  (the section's home)
from dpo_megatron.utils import ranks
from dpo_megatron.utils.files import write_text_atomic
from dpo_megatron.utils.run_layout import RunLayout

"""One JSON record per logged step and split, in the run directory."""
_CONSOLE_KEYS = (
    ("loss", "loss"),
    ("rewards/accuracies", "acc"),
    ("rewards/margins", "margin"),
    ("nll_loss", "nll"),
    ("logps/chosen", "logps/chosen"),
    ("logps/rejected", "logps/rejected"),
    ("kl", "kl"),
    ("beta_dpo/beta", "beta"),
    ("moe/aux_loss", "moe_aux"),
)


def strict_json_value(value):
    """``value`` with every non-finite float replaced by ``"NaN"`` / ``"Infinity"`` /
    ``"-Infinity"`` (recursively through dicts and lists), for ``json.dumps(allow_nan=False)``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json_value(v) for v in value]
    return value


def truncate_metrics(path: str, last_step: int) -> int:
    """Drop records of steps after ``last_step`` from a metrics.jsonl, and a torn last line (with
    a warning); the file is rewritten atomically when anything changes. Returns how many records
    were dropped (the torn line not counted).

    Raises:
        ValueError: a line other than the last is not JSON (naming the file and line).
    """
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    kept, dropped, torn = [], 0, False
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if number < len(lines):
                raise ValueError(
                    f"{path}: line {number}: not a JSON record ({e}); fix or "
                    f"remove that line to resume"
                ) from None
            warnings.warn(
                f"{path}: dropped its torn last line {number} ({line.strip()[:80]!r}, "
                f"written when the run was killed)"
            )
            torn = True
            continue
        if record.get("step", 0) <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
        else:
            dropped += 1
    if dropped or torn or (lines and not lines[-1].endswith("\n")):
        write_text_atomic(path, "".join(kept))
    return dropped


def split_records(path: str, split: str) -> Iterator[dict]:
    """The records of ``split`` (``train``, ``eval``) in a metrics.jsonl, in file order:
    ``{"step", "split", metric name: value, ...}`` (none when the file is missing)."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if record.get("split") == split:
                    yield record


def last_record(path: str, split: str) -> dict:
    """The last record of ``split`` in a metrics.jsonl ({} when the file or such a record is
    missing; :func:`split_records`)."""
    last = {}
    for record in split_records(path, split):
        last = record
    return last


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``, ``3725`` -> ``1h02m``: the progress line's elapsed / ETA."""
    seconds = int(round(max(seconds, 0.0)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class MetricsLogger:
    """Writes one record per step to console, TensorBoard, W&B and ``<run_dir>/metrics.jsonl``.

    Args:
        config: the ``logging`` config section (None: TensorBoard only).
        run: the run folder (its RunLayout, or the folder path).
        total_steps: the run's ``train_iters`` (for ``step/total`` and the ETA).
        start_step: the step a resumed run starts after; the ETA uses the steps of this process
            only, and metrics.jsonl records past it are dropped.
        run_config: the full config as a plain dict, given to W&B.
    """

    def __init__(
        self,
        config: LoggingConfig | None = None,
        *,
        run: RunLayout | str,
        total_steps: int,
        start_step: int = 0,
        run_config: dict | None = None,
    ):
        config = config or LoggingConfig()
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = ranks.is_rank0()  # every rank holds the same reduced metrics
        self.start = time.time()
        self.writer = None
        self.jsonl = None
        self.wandb = None
        self.write_error: str | None = None
        """The first failed write into the run folder (a full or read-only disk), in words with
        its file; None while every write succeeded. Rank 0 only."""
        if not self.enabled:
            return
        layout = run if isinstance(run, RunLayout) else RunLayout(run)
        path, dropped = layout.metrics, 0
        with self.writing(path):
            os.makedirs(layout.run_dir, exist_ok=True)
            dropped = truncate_metrics(path, start_step)
            self.jsonl = open(path, "a", encoding="utf-8")
        if dropped:
            print(
                f"note: {path}: dropped {dropped} record{'s' * (dropped != 1)} of steps after "
                f"{start_step}, the checkpoint resumed from (this run logs those steps again)",
                flush=True,
            )
        if config.tensorboard and self.write_error is None:
            from torch.utils.tensorboard import SummaryWriter

            from dpo_megatron.compat.tensorboard_writer_thread import quiet_writer_thread_errors

            quiet_writer_thread_errors()  # a failed append is reported here, in one line
            with self.writing(layout.tensorboard):
                self.writer = SummaryWriter(
                    layout.tensorboard,
                    purge_step=start_step + 1 if start_step else None,
                )
        if config.wandb_project:
            self.wandb = _start_wandb(config, layout.run_dir, run_config)

    @contextlib.contextmanager
    def writing(self, path: str) -> Iterator[None]:
        """Around a write of rank 0 into the run folder (``path``: what it writes): an
        ``OSError`` is kept as :attr:`write_error` (the first one) instead of raised."""
        try:
            yield
        except OSError as e:
            if self.write_error is None:
                from dpo_megatron.checkpointing.storage import describe_storage_error

                self.write_error = describe_storage_error(e, path)

    def agreed_write_error(self) -> str | None:
        """Rank 0's :attr:`write_error` on every rank (collective: call it at the same point on
        every rank, once per step)."""
        return ranks.broadcast_from_rank0(self.write_error)

    def log(
        self,
        step: int,
        split: str,
        metrics: dict[str, float],
        extra: dict[str, float] | None = None,
    ) -> None:
        """Record ``metrics`` (+ ``extra`` like lr, grad_norm, tokens/s) under ``split/``."""
        if not self.enabled:
            return
        values = {**metrics, **(extra or {})}
        record = {"step": step, "split": split, **values}
        if self.write_error is None:  # after a failed write no file is written again
            with self.writing(self.jsonl.name):
                self.jsonl.write(json.dumps(strict_json_value(record), allow_nan=False) + "\n")
                self.jsonl.flush()
        scalars = {
            f"{split}/{k}": v
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self.writer is not None and self.write_error is None:
            with self.writing(self.writer.log_dir):
                for k, v in scalars.items():
                    self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        print(self.line(step, split, values), flush=True)

    def line(self, step: int, split: str, values: dict[str, float]) -> str:
        """The progress line: ``[train] step 3/10 | loss 0.6931 | acc 0.5000 | ... | elapsed
        12s | eta 28s``. Before the run's first step (a step-0 evaluation) there is no pace to
        extrapolate: no eta."""
        elapsed = time.time() - self.start
        done = step - self.start_step
        parts = [f"[{split}] step {step}/{self.total_steps}"]
        parts += [
            f"{label} {values[k]:.4f}" for k, label in _CONSOLE_KEYS if values.get(k) is not None
        ]
        for k, label, fmt in (
            ("grad_norm", "grad_norm", "{:.3f}"),
            ("lr", "lr", "{:.2e}"),
            ("tokens_per_s", "tokens/s", "{:.0f}"),
            ("step_time_s", "step", "{:.2f}s"),
            ("skipped_steps", "skipped", "{:d}"),
        ):
            if values.get(k) is not None:
                parts.append(f"{label} " + fmt.format(values[k]))
        timing = f"elapsed {format_duration(elapsed)}"
        if done > 0:
            eta = elapsed / done * max(self.total_steps - step, 0)
            timing += f" eta {format_duration(eta)}"
        parts.append(timing)
        return " | ".join(parts)

    def close(self) -> None:
        """Close the files (a failed last write is kept in :attr:`write_error`) and W&B."""
        if self.jsonl:
            with self.writing(self.jsonl.name):
                self.jsonl.close()
        if self.writer:
            with self.writing(self.writer.log_dir):
                self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(config: LoggingConfig, run_dir: str, run_config: dict | None):
    """A W&B run, or None (with a warning) when the package is not installed."""
    try:
        import wandb
    except ImportError:
        warnings.warn(
            "logging.wandb_project is set but the wandb package is not installed "
            "(pip install wandb): logging to TensorBoard and metrics.jsonl only"
        )
        return None
    return wandb.init(
        project=config.wandb_project,
        entity=config.wandb_entity or None,
        name=config.wandb_run_name or os.path.basename(os.path.abspath(run_dir)),
        dir=run_dir,
        config=run_config,
        resume="allow",
    )
