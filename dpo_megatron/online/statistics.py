"""Bootstrap intervals of a held-out evaluation's mean (pure numpy: no torch, no process group).

An evaluation holds one value per (prompt, sample): a [P, K] array (P held-out prompts, K samples
each). Samples of one prompt are correlated (same prompt, same policy), so the bootstrap
resamples in two stages, the prompts with replacement, then within each drawn prompt its samples
with replacement (the two-stage bootstrap of clustered data, Davison & Hinkley 1997, "Bootstrap
Methods and their Application", section 3.8; it errs on the wide side). The interval is the
percentile interval of the resampled means (Efron & Tibshirani 1993, section 13.3).

A difference between two evaluations of the same prompts is paired: sample j of prompt i comes
from the same random stream in every evaluation (the evaluation's fixed seed), so one resample
of (prompt, sample) indices is applied to both arrays and the interval is that of the mean of
the per-(prompt, sample) differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
"""Two-sided coverage of the intervals."""
RESAMPLES = 10_000
"""Bootstrap resamples per interval."""
_RESAMPLES_PER_BLOCK = 1_000  # index arrays of [block, P, K]: bounded memory for any P x K


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval.

    Attributes:
        mean: the mean over every (prompt, sample) value (not resampled).
        low, high: the interval's ends (percentiles ``(1 - CONFIDENCE) / 2`` and
            ``(1 + CONFIDENCE) / 2`` of the resampled means).
    """

    mean: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        """Whether the whole interval lies above 0 or below 0."""
        return self.low > 0 or self.high < 0


def _as_matrix(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"{name}: a [prompts, samples] array is needed, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: holds a value that is not finite")
    return array


def bootstrap_mean(
    values, *, seed: int, resamples: int = RESAMPLES, confidence: float = CONFIDENCE
) -> Interval:
    """The mean of ``values`` ([P, K]: P prompts, K samples each) with its two-stage bootstrap
    interval (module docstring); the same interval for the same ``seed``.

    Raises:
        ValueError: ``values`` is not a non-empty 2-D array of finite numbers, ``resamples`` < 1
            or ``confidence`` outside (0, 1).
    """
    array = _as_matrix(values, "values")
    return _interval(array, seed, resamples, confidence)


def bootstrap_mean_difference(
    before, after, *, seed: int, resamples: int = RESAMPLES, confidence: float = CONFIDENCE
) -> Interval:
    """mean(after) - mean(before) of two evaluations of the same prompts ([P, K] each, sample
    j of prompt i paired), with the paired two-stage bootstrap interval (module docstring).

    Raises:
        ValueError: the arrays differ in shape, or as :func:`bootstrap_mean`.
    """
    a, b = _as_matrix(before, "before"), _as_matrix(after, "after")
    if a.shape != b.shape:
        raise ValueError(f"before has shape {a.shape}, after {b.shape}: the same prompts needed")
    return _interval(b - a, seed, resamples, confidence)


def _interval(array: np.ndarray, seed: int, resamples: int, confidence: float) -> Interval:
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be >= 1")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    prompts, samples = array.shape
    means = np.empty(resamples)
    for start in range(0, resamples, _RESAMPLES_PER_BLOCK):
        block = min(_RESAMPLES_PER_BLOCK, resamples - start)
        drawn = rng.integers(0, prompts, size=(block, prompts))  # prompts, with replacement
        within = rng.integers(0, samples, size=(block, prompts, samples))  # then their samples
        means[start : start + block] = array[drawn[:, :, None], within].mean(axis=(1, 2))
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(float(array.mean()), float(low), float(high))
