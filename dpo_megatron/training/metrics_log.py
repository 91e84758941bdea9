"""Step logs on rank 0: a console line, TensorBoard scalars and a metrics.jsonl file.

Metric names follow TRL (``rewards/chosen``, ``rewards/margins``, ``logps/chosen`` ...): rewards
are beta-scaled policy-vs-reference log-ratios in nats, logps are summed completion log-probs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch.distributed as dist

_CONSOLE_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")


def is_logging_rank() -> bool:
    """Global rank 0 writes logs (every rank holds the same reduced metrics)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsLogger:
    """Writes one record per step to console, TensorBoard and ``<run_dir>/metrics.jsonl``."""

    def __init__(self, run_dir: str, total_steps: int, tensorboard: bool = True):
        self.total_steps = total_steps
        self.enabled = is_logging_rank()
        self.start = time.time()
        self.writer = None
        self.jsonl = None
        if not self.enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, step: int, split: str, metrics: dict[str, float],
            extra: Optional[dict[str, float]] = None) -> None:
        """Record ``metrics`` (+ ``extra`` like lr, grad_norm, tokens/s) under ``split/``."""
        if not self.enabled:
            return
        values = {**metrics, **(extra or {})}
        record = {"step": step, "split": split, **values}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in values.items():
                if v is not None:
                    self.writer.add_scalar(f"{split}/{k}", v, step)
        print(self._line(step, split, values), flush=True)

    def _line(self, step: int, split: str, values: dict[str, float]) -> str:
        elapsed = time.time() - self.start
        eta = elapsed / max(step, 1) * max(self.total_steps - step, 0)
        parts = [f"[{split}] step {step}/{self.total_steps}"]
        parts += [f"{k} {values[k]:.4f}" for k in _CONSOLE_KEYS if k in values]
        for k, fmt in (("grad_norm", "{:.3f}"), ("lr", "{:.2e}"), ("tokens_per_s", "{:.0f}"),
                       ("step_time_s", "{:.2f}")):
            if values.get(k) is not None:
                parts.append(f"{k} " + fmt.format(values[k]))
        parts.append(f"elapsed {elapsed:.0f}s eta {eta:.0f}s")
        return " | ".join(parts)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.writer:
            self.writer.close()
