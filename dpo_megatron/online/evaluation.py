"""What the held-out evaluation of an online run reports, from its scored samples: the mean score
with its bootstrap interval, the change since the starting policy with the paired interval, and
the sampled KL from the starting policy (``online.statistics``); the run's closing summary
(``online/summary.json``, the printed table) and its plot (``online/evaluation.png``).

Records in, records out (``online.records``; no torch, no process group): rank 0 calls these
with the rows of ``eval_start.jsonl`` and each round's ``eval.jsonl``.

KL: an evaluation row holds the completion's log-probability under the evaluated policy
(``logp``) and under the starting policy (``logp_initial``), in nats at temperature 1. The mean
of ``logp - logp_initial`` over completions sampled from the policy is the Monte Carlo estimate
of KL(policy || initial) per completion (Schulman's k1, the estimate TRL's online trainers log
as ``objective/kl``): unbiased when the samples come from the policy itself
(``online.sampling.temperature=1``, ``top_p=1``); with another temperature or top-p it is the
mean log-ratio on the samples drawn, no longer an unbiased KL.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from dpo_megatron.online.records import (
    EvalSample,
    EvaluationEntry,
    RoundSummary,
    RunSummary,
    RunTimes,
)
from dpo_megatron.online.statistics import (
    CONFIDENCE,
    RESAMPLES,
    Interval,
    bootstrap_mean,
    bootstrap_mean_difference,
)

INTERVAL_METHOD = (
    f"{100 * CONFIDENCE:.0f}% two-stage bootstrap percentile interval ({RESAMPLES} resamples of "
    "prompts, then of samples within each); the change is paired by (prompt, sample)"
)
KL_METHOD = (
    "mean over the held-out samples of log pi(y|x) - log pi_initial(y|x), nats per completion "
    "(an unbiased estimate of KL(pi || pi_initial) when sampled at temperature 1, top_p 1)"
)


def value_matrix(rows: Sequence[EvalSample], values: Sequence[float]) -> np.ndarray:
    """[P, K] array of ``values[i]`` at row ``i``'s (``prompt``, ``sample``).

    Raises:
        ValueError: the rows do not cover every (prompt, sample) of a P x K grid exactly once.
    """
    prompts = 1 + max(r.prompt for r in rows)
    samples = 1 + max(r.sample for r in rows)
    out = np.full((prompts, samples), np.nan)
    for r, value in zip(rows, values):
        out[r.prompt, r.sample] = value
    if len(rows) != prompts * samples or np.isnan(out).any():
        raise ValueError(f"evaluation rows do not fill a {prompts} x {samples} grid")
    return out


def kl_values(rows: Sequence[EvalSample]) -> np.ndarray | None:
    """[P, K] ``logp - logp_initial`` (nats), or None for rows of the starting policy (no
    log-probabilities: the KL is 0)."""
    if rows[0].logp is None:
        return None
    return value_matrix(rows, [r.logp - r.logp_initial for r in rows])


def evaluation_entry(
    rows: Sequence[EvalSample], start_rows: Sequence[EvalSample], *, round_index: int, seed: int
) -> EvaluationEntry:
    """The report of one evaluation (``round_index`` -1: the starting policy's): the mean score,
    the change since the start (None for the start) and the KL from the starting policy (nats
    per completion), each with its interval at :data:`CONFIDENCE`, the same for the same
    ``seed``."""
    scores = value_matrix(rows, [r.score for r in rows])
    change = None
    if round_index >= 0:
        before = value_matrix(start_rows, [r.score for r in start_rows])
        change = bootstrap_mean_difference(before, scores, seed=seed)
    kl = kl_values(rows)
    return EvaluationEntry(
        round=round_index,
        prompts=int(scores.shape[0]),
        samples_per_prompt=int(scores.shape[1]),
        completion_tokens=float(np.mean([len(r.completion_ids) for r in rows])),
        score=bootstrap_mean(scores, seed=seed),
        score_change=change,
        kl_from_initial=Interval(0.0, 0.0, 0.0) if kl is None else bootstrap_mean(kl, seed=seed),
    )


def _label(round_index: int) -> str:
    return "start" if round_index < 0 else f"round {round_index}"


def summary_lines(entries: Sequence[EvaluationEntry], scorer: str) -> list[str]:
    """The closing table: one line per evaluation (score, change since the start, KL)."""
    if not entries:
        return []
    first = entries[0]
    lines = [
        f"online: held-out evaluation ({first.prompts} prompts x "
        f"{first.samples_per_prompt} samples, scorer {scorer}; mean "
        f"[{100 * CONFIDENCE:.0f}% bootstrap interval]):"
    ]
    for e in entries:
        s, kl = e.score, e.kl_from_initial
        line = f"  {_label(e.round):<9} score {s.mean:.4f} [{s.low:.4f}, {s.high:.4f}]"
        if e.score_change is not None:
            c = e.score_change
            line += (
                f"  change {c.mean:+.4f} [{c.low:+.4f}, {c.high:+.4f}]"
                f"  KL {kl.mean:.3f} [{kl.low:.3f}, {kl.high:.3f}] nats"
            )
        lines.append(line + f"  ({e.completion_tokens:.1f} tokens)")
    return lines


def plot_evaluation(entries: Sequence[EvaluationEntry], path: str, scorer: str) -> None:
    """A PNG at ``path`` (atomic): the held-out mean score and the KL from the starting policy
    by round, each with its interval (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpo_megatron.utils.files import atomic_file

    x = np.arange(len(entries))
    labels = [_label(e.round).replace("round ", "") for e in entries]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), constrained_layout=True)
    for ax, intervals, title in (
        (axes[0], [e.score for e in entries], f"held-out mean score ({scorer})"),
        (
            axes[1],
            [e.kl_from_initial for e in entries],
            "KL from the starting policy (nats / completion)",
        ),
    ):
        mean = np.array([i.mean for i in intervals])
        low = np.array([i.low for i in intervals])
        high = np.array([i.high for i in intervals])
        ax.errorbar(x, mean, yerr=[mean - low, high - mean], marker="o", capsize=4)
        ax.set_xticks(x, labels)
        ax.set_xlabel("after round")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{100 * CONFIDENCE:.0f}% bootstrap intervals", fontsize=9)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def run_summary(
    entries: Sequence[EvaluationEntry],
    rounds: Sequence[RoundSummary],
    *,
    scorer: str,
    final_policy: str,
    plot: str | None,
    start_eval_s: float | None,
) -> RunSummary:
    """``online/summary.json``: the evaluations by round, each round's counts and wall times,
    where the final policy is and how the intervals and the KL were computed."""
    return RunSummary(
        scorer=scorer,
        final_policy=final_policy,
        plot=plot,
        evaluation=tuple(entries),
        interval=INTERVAL_METHOD,
        kl=KL_METHOD,
        rounds=tuple(r.outline() for r in rounds),
        wall_s=RunTimes(
            eval_start=start_eval_s,
            rounds=sum(r.wall_s.total() for r in rounds if r.wall_s is not None),
        ),
    )


def final_policy_line(final_policy: str, summary_path: str, plot: str | None) -> str:
    """Where the run left its policy and its report (the run's last line)."""
    where = f"online: final policy {final_policy}"
    if os.path.isfile(os.path.join(final_policy, "metadata.json")):  # a checkpoint of a round
        where += (
            f" (continue: model.load={final_policy}; as an HF folder: "
            f"scripts/convert_megatron_to_hf.py --load {final_policy} --save OUT)"
        )
    return where + f" | summary {summary_path}" + (f" | plot {plot}" if plot else "")
