"""Running mean of BCO's rewards across optimizer steps (the reward shift delta of BCO)."""

from __future__ import annotations

from typing import Any


class RunningRewardMean:
    """Cumulative mean of the per-step global reward mean, one entry per optimizer step.

    Every step averages the same number of pairs (the global batch), so the mean of step means is
    the mean over all rewards seen, as TRL's `RunningMoments` computes it. Updated only through
    `update`, i.e. after the optimizer step, so all micro-batches and ranks of a step see the same
    delta.
    """

    metric = "bco/reward_mean"
    """Name of the per-pair metric whose global average is folded in after each step."""

    def __init__(self) -> None:
        self.mean = 0.0
        self.count = 0

    def loss_kwargs(self) -> dict[str, Any]:
        return {"reward_mean": self.mean}

    def update(self, global_metrics: dict[str, float]) -> None:
        """Fold in one step.

        Raises:
            KeyError: `global_metrics` lacks `bco/reward_mean` (the engine must pass the averaged
                metrics the loss returned).
        """
        if self.metric not in global_metrics:
            raise KeyError(
                f"bco_pair needs the step's global {self.metric!r} metric; got "
                f"{sorted(global_metrics)}"
            )
        self.count += 1
        self.mean += (float(global_metrics[self.metric]) - self.mean) / self.count

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = float(state["mean"])
        self.count = int(state["count"])
