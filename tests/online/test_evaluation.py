"""The held-out evaluation's statistics: bootstrap intervals that pair two evaluations by
(prompt, sample), match the normal approximation on a large sample, and are reproducible; the
report built from evaluation rows (KL from the log-probabilities, 0 for the starting policy),
its table, plot and the prompts' left-out warning."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpo_megatron.online.evaluation import (
    evaluation_entry,
    plot_evaluation,
    summary_lines,
    value_matrix,
)
from dpo_megatron.online.prompts import left_out_warning
from dpo_megatron.online.records import EvalSample
from dpo_megatron.online.statistics import Interval, bootstrap_mean, bootstrap_mean_difference


def test_a_paired_shift_has_a_zero_width_interval():
    """A difference of exactly +0.1 on every (prompt, sample) is +0.1 in every paired resample,
    however noisy the scores; an unpaired resampling would give a wide interval."""
    rng = np.random.default_rng(0)
    before = rng.uniform(size=(20, 4))
    d = bootstrap_mean_difference(before, before + 0.1, seed=1)
    assert (d.mean, d.low, d.high) == pytest.approx((0.1, 0.1, 0.1), abs=1e-12)
    assert d.excludes_zero()


def test_the_interval_matches_the_normal_approximation_on_a_large_sample():
    """2000 prompts x 1 sample of a fair coin: 95% half-width 1.96 * sqrt(0.25 / 2000)."""
    values = np.random.default_rng(3).integers(0, 2, size=(2000, 1)).astype(float)
    got = bootstrap_mean(values, seed=0)
    half = 1.96 * math.sqrt(0.25 / 2000)
    assert got.mean == values.mean()
    assert got.low < got.mean < got.high
    assert (got.high - got.low) / 2 == pytest.approx(half, rel=0.1)


def test_clustered_samples_widen_the_interval():
    """Samples that repeat their prompt's value carry no more information than one per prompt:
    the interval of 50 prompts x 8 identical samples is that of 50 x 1, not of 400 values."""
    per_prompt = np.random.default_rng(5).normal(size=(50, 1))
    one = bootstrap_mean(per_prompt, seed=2)
    eight = bootstrap_mean(np.repeat(per_prompt, 8, axis=1), seed=2)
    assert eight.high - eight.low == pytest.approx(one.high - one.low, rel=0.05)


def test_same_seed_same_interval_and_bad_input_refused():
    values = np.random.default_rng(1).uniform(size=(6, 3))
    assert bootstrap_mean(values, seed=4) == bootstrap_mean(values, seed=4)
    with pytest.raises(ValueError, match="a \\[prompts, samples\\] array"):
        bootstrap_mean([1.0, 2.0], seed=0)
    with pytest.raises(ValueError, match="not finite"):
        bootstrap_mean([[1.0, float("nan")]], seed=0)
    with pytest.raises(ValueError, match="the same prompts"):
        bootstrap_mean_difference(values, values[:5], seed=0)


def _rows(scores, logp=None, logp_initial=None):
    rows = []
    for i, row in enumerate(scores):
        for j, score in enumerate(row):
            rows.append(
                EvalSample(
                    round="eval",
                    prompt=i,
                    sample=j,
                    row=i,
                    prompt_text="p",
                    completion_text="c",
                    prompt_ids=(1,),
                    completion_ids=(5,) * (i + j + 1),
                    logp=None if logp is None else logp[i][j],
                    logp_initial=None if logp is None else logp_initial[i][j],
                    score=score,
                )
            )
    return rows


def test_the_report_of_an_evaluation(tmp_path):
    start = _rows([[0.0, 0.5], [0.25, 0.25]])
    after = _rows(
        [[0.5, 1.0], [0.75, 0.75]], logp=[[-3.0, -4.0], [-2.0, -1.0]],
        logp_initial=[[-5.0, -4.5], [-2.0, -3.0]],
    )  # fmt: skip
    first = evaluation_entry(start, start, round_index=-1, seed=0)
    assert first.score.mean == pytest.approx(0.25) and first.score_change is None
    assert first.kl_from_initial == Interval(0.0, 0.0, 0.0)
    entry = evaluation_entry(after, start, round_index=0, seed=0)
    assert entry.prompts == 2 and entry.samples_per_prompt == 2
    assert entry.completion_tokens == pytest.approx((1 + 2 + 2 + 3) / 4)
    change = entry.score_change
    assert (change.mean, change.low, change.high) == pytest.approx((0.5, 0.5, 0.5))
    kl = entry.kl_from_initial  # log-ratios 2, 0.5, 0, 2
    assert kl.mean == pytest.approx(1.125) and 0 <= kl.low <= kl.mean <= kl.high <= 2
    lines = summary_lines([first, entry], "my.judge:fn")
    assert lines[0].startswith("online: held-out evaluation (2 prompts x 2 samples")
    assert "start     score 0.2500" in lines[1]
    assert "round 0   score 0.7500" in lines[2] and "change +0.5000 [+0.5000, +0.5000]" in lines[2]
    plot = tmp_path / "evaluation.png"
    plot_evaluation([first, entry], str(plot), "my.judge:fn")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="do not fill a 2 x 2 grid"):
        value_matrix(start[:3], [r.score for r in start[:3]])


def test_prompts_left_out_for_length_warn_above_a_tenth():
    assert left_out_warning(10, 100, 128) is None
    assert left_out_warning(59, 100, 128) == (
        "WARNING: 59 of 100 prompts (59%) were left out: longer than "
        "data.max_prompt_length=128 tokens (raise data.max_prompt_length, or pick other rows "
        "with online.prompts_offset / online.prompts_limit)"
    )
