"""Every file and folder of a run folder, named in one place.

A run folder (``run_dir``) holds::

    run.lock          the lock of the run that owns the folder
    config.yaml       the resolved config of the latest start
    train.log         what rank 0 printed, every start appended
    metrics.jsonl     one JSON record per logged step / evaluation
    tensorboard/      TensorBoard events (logging.tensorboard)
    samples/          decoded evaluation samples, step_<step>.jsonl
    checkpoints/      iter_<step>/ checkpoints (or checkpoint.save), and the HF exports
                      checkpoints/hf (merged) and checkpoints/hf_adapter (PEFT adapter)
    online/           an online (iterative DPO) run: state.json, eval_start.jsonl,
                      summary.json and evaluation.png (the run's closing report) and
                      round_<r>/, each round a run folder of its own training plus
                      samples.jsonl, scores.jsonl, pairs.jsonl, eval.jsonl and summary.json

The code that writes or reads one of these asks a :class:`RunLayout` for its path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run folder.

    Args:
        run_dir: the run folder (``run_dir``).
        save: ``checkpoint.save`` (the checkpoint folder when set; ``<run_dir>/checkpoints``
            when empty).
    """

    run_dir: str
    save: str = ""

    LOCK: ClassVar[str] = "run.lock"
    CONFIG: ClassVar[str] = "config.yaml"
    LOG: ClassVar[str] = "train.log"
    METRICS: ClassVar[str] = "metrics.jsonl"
    TENSORBOARD: ClassVar[str] = "tensorboard"
    SAMPLES: ClassVar[str] = "samples"
    CHECKPOINTS: ClassVar[str] = "checkpoints"
    HF_EXPORT: ClassVar[str] = "hf"
    HF_ADAPTER: ClassVar[str] = "hf_adapter"
    ONLINE: ClassVar[str] = "online"
    ONLINE_STATE: ClassVar[str] = "state.json"
    ONLINE_EVAL_START: ClassVar[str] = "eval_start.jsonl"
    ONLINE_SUMMARY: ClassVar[str] = "summary.json"
    ONLINE_PLOT: ClassVar[str] = "evaluation.png"
    ROUND_SAMPLES: ClassVar[str] = "samples.jsonl"
    ROUND_SCORES: ClassVar[str] = "scores.jsonl"
    ROUND_PAIRS: ClassVar[str] = "pairs.jsonl"
    ROUND_SUMMARY: ClassVar[str] = "summary.json"
    ROUND_EVAL: ClassVar[str] = "eval.jsonl"

    @classmethod
    def of(cls, cfg) -> RunLayout:
        """The layout of a run config (``cfg.run_dir``, ``cfg.checkpoint.save``)."""
        return cls(cfg.run_dir, cfg.checkpoint.save)

    def _in_run(self, name: str) -> str:
        return os.path.join(self.run_dir, name)

    @property
    def lock(self) -> str:
        """``run.lock`` (in the real path of the folder: one lock however it is reached)."""
        return os.path.join(os.path.realpath(self.run_dir), self.LOCK)

    @property
    def config(self) -> str:
        return self._in_run(self.CONFIG)

    @property
    def log(self) -> str:
        return self._in_run(self.LOG)

    @property
    def metrics(self) -> str:
        return self._in_run(self.METRICS)

    @property
    def tensorboard(self) -> str:
        return self._in_run(self.TENSORBOARD)

    @property
    def samples(self) -> str:
        return self._in_run(self.SAMPLES)

    def samples_file(self, step: int) -> str:
        """``samples/step_<step, 7 digits>.jsonl``."""
        return os.path.join(self.samples, f"step_{step:07d}.jsonl")

    @property
    def checkpoints(self) -> str:
        """``checkpoint.save`` or ``<run_dir>/checkpoints``."""
        return self.save or self._in_run(self.CHECKPOINTS)

    @property
    def hf_export(self) -> str:
        """The merged Hugging Face export, ``<checkpoints>/hf``."""
        return os.path.join(self.checkpoints, self.HF_EXPORT)

    @property
    def hf_adapter(self) -> str:
        """The PEFT adapter export, ``<checkpoints>/hf_adapter``."""
        return os.path.join(self.checkpoints, self.HF_ADAPTER)

    @property
    def online(self) -> str:
        """``online/``: the rounds of an online (iterative DPO) run."""
        return self._in_run(self.ONLINE)

    @property
    def online_state(self) -> str:
        """``online/state.json``: the finished phases of each round."""
        return os.path.join(self.online, self.ONLINE_STATE)

    @property
    def online_eval_start(self) -> str:
        """``online/eval_start.jsonl``: the starting policy's scored held-out samples."""
        return os.path.join(self.online, self.ONLINE_EVAL_START)

    @property
    def online_summary(self) -> str:
        """``online/summary.json``: the run's held-out evaluations, rounds and final policy."""
        return os.path.join(self.online, self.ONLINE_SUMMARY)

    @property
    def online_plot(self) -> str:
        """``online/evaluation.png``: held-out score and KL by round."""
        return os.path.join(self.online, self.ONLINE_PLOT)

    @property
    def online_checkpoints(self) -> str:
        """Where an online run's checkpoints go: ``online/round_<r>/checkpoints``, one folder
        per round (the pattern, for messages)."""
        return os.path.join(self.online, "round_<r>", self.CHECKPOINTS)

    def online_round(self, index: int) -> str:
        """``online/round_<index>``: a round's files and the run folder of its training."""
        return os.path.join(self.online, f"round_{index}")

    def round_samples(self, index: int) -> str:
        """``online/round_<index>/samples.jsonl``: the round's sampled completions."""
        return os.path.join(self.online_round(index), self.ROUND_SAMPLES)

    def round_scores(self, index: int) -> str:
        """``online/round_<index>/scores.jsonl``: the scorer's score of each sample."""
        return os.path.join(self.online_round(index), self.ROUND_SCORES)

    def round_pairs(self, index: int) -> str:
        """``online/round_<index>/pairs.jsonl``: the preference pairs the round trains on."""
        return os.path.join(self.online_round(index), self.ROUND_PAIRS)

    def round_summary(self, index: int) -> str:
        """``online/round_<index>/summary.json``: the round's counts, training metrics, wall
        times and held-out evaluation."""
        return os.path.join(self.online_round(index), self.ROUND_SUMMARY)

    def round_eval(self, index: int) -> str:
        """``online/round_<index>/eval.jsonl``: the held-out samples after the round, scored."""
        return os.path.join(self.online_round(index), self.ROUND_EVAL)
