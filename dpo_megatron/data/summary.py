"""Summarise stage: the start-up summary of a data load (counts, drops by reason, token-length
percentiles) from the selected sources (:func:`summarize`), its text and its drop warning."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.kinds import ItemKind
from dpo_megatron.data.pairs import DataSummary, DuplicateReport, LengthStats, SourceSummary
from dpo_megatron.data.selection import TRUNCATION_KINDS, SelectedSource

PERCENTILES = (50, 90, 99)

NOTES = {
    "diverged_early": "HH dialogues that differ before their last turn, split after their last "
    "common '\\n\\nAssistant:' (completions of several turns)",
    "prompt_ends_with_space": "text prompts ending in a space (a lone space token at the "
    "prompt/completion boundary)",
    "text_bounded": "examples with a text far over the length limits, cut before tokenizing",
    "prompt_differs": "UltraFeedback rows whose 'prompt' is not their conversations' last user "
    "turn; the conversations' turns are the prompt trained on",
}
"""What each note counted in the summary means (``Example.notes``, ``encode.Encoded.notes``)."""

DROP_WARNING_SHARE = 0.10
"""A load that drops more than this share of its items prints a warning (:func:`drop_warning`):
a tenth of the data lost is more than a user would accept without a word, and every drop reason
below it stays visible in the summary's counts."""

DROP_REMEDIES = {
    "prompt_too_long": "the prompt leaves no room for a completion in data.max_length: raise "
    "data.max_length, or set data.max_prompt_length (> 0) to cut long "
    "prompts instead of dropping their pairs",
    "identical_after_cut": "chosen and rejected are the same once cut to data.max_length: "
    "raise data.max_length",
    "duplicate": "data.drop_duplicates=false keeps repeated pairs",
    "malformed": "rows that could not be read (data.on_error=skip drops them; fix the file)",
    "shp_pairs_per_post": "data.shp_max_pairs_per_post caps pairs per post (0: no cap)",
    "score_ratio": "SHP pairs under data.shp_min_score_ratio",
}
"""Drop reason -> what it means and the config key that changes it (reasons not listed, such
as ``identical``, are facts of the rows: no key keeps them)."""


def length_stats(lengths: Sequence[int]) -> LengthStats:
    """:class:`LengthStats` of token lengths (all 0 for none)."""
    if len(lengths) == 0:
        return LengthStats()
    values = np.asarray(lengths)
    p50, p90, p99 = (int(np.percentile(values, q, method="inverted_cdf")) for q in PERCENTILES)
    return LengthStats(p50, p90, p99, int(values.max()))


def summarize(
    selected: Sequence[SelectedSource], train: list, eval_: list, cfg: DataConfig, kind: ItemKind
) -> DataSummary:
    """The :class:`DataSummary` of a load: rows read, items kept (counted in the kind's
    ``unit``), the train / eval sizes, drops by reason, cuts by kind, notes, duplicates, length
    percentiles before and after the cuts (``rejected`` only for a kind that reads it) and per
    source its counts.

    Args:
        selected: every source (training then eval) after selection.
        train, eval_: the mixed training items and the eval items.
    """
    dropped: Counter = Counter()
    truncated: Counter = Counter()
    notes: Counter = Counter()
    names = ("prompt", "chosen", "rejected") if kind.reads_rejected else ("prompt", "chosen")
    before: dict[str, list[int]] = {k: [] for k in names}
    after: dict[str, list[int]] = {k: [] for k in (*names, "pair")}
    for s in selected:
        dropped.update(s.dropped)
        truncated.update(s.truncated)
        notes.update(s.notes)
        for k in names:
            before[k].extend(getattr(s.lengths_before, k))
            after[k].extend(getattr(s.lengths, k))
        after["pair"].extend(s.pair_lengths)
    return DataSummary(
        unit=kind.unit,
        rows_read=sum(s.rows_read for s in selected),
        kept=sum(len(s.kept) for s in selected),
        train=len(train),
        eval=len(eval_),
        max_length=cfg.max_length,
        max_prompt_length=cfg.max_prompt_length,
        dropped=dict(dropped),
        truncated={k: truncated[k] for k in TRUNCATION_KINDS},
        notes=dict(notes),
        duplicates=DuplicateReport(
            count=sum(len(s.duplicates) for s in selected),
            dropped=cfg.drop_duplicates,
            examples=tuple(
                f"{s.label}: {where} repeats {first}"
                for s in selected
                for where, first in s.duplicates[:3]
            ),
        ),
        lengths_before_cut={k: length_stats(v) for k, v in before.items()},
        lengths={k: length_stats(v) for k, v in after.items()},
        sources=[
            SourceSummary(
                s.label,
                s.format,
                s.rows_read,
                len(s.kept),
                dict(s.dropped),
                s.role,
                dict(s.first_dropped),
            )
            for s in selected
        ],
    )


def format_summary(summary: DataSummary) -> str:
    """Human-readable multi-line text of a :class:`DataSummary`; a kind of one completion per
    item (SFT, KTO) names it ``completion`` and its model row a ``sequence``."""
    lines = [
        f"data: {summary.rows_read} rows read, {summary.kept} {summary.unit} kept "
        f"({summary.train} train, {summary.eval} eval), max_length {summary.max_length}, "
        f"max_prompt_length {summary.max_prompt_length}"
    ]
    for source in summary.sources:
        dropped = (
            ", ".join(
                f"{k} {v}"
                + (f" (first: {source.first_dropped[k]})" if k in source.first_dropped else "")
                for k, v in sorted(source.dropped.items())
            )
            or "none"
        )
        role = "eval set " if source.role == "eval" else ""
        lines.append(
            f"  {role}{source.label} ({source.format}): {source.rows_read} rows, "
            f"{source.kept} kept, dropped: {dropped}"
        )
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(summary.dropped.items())) or "none"
    lines.append(f"  dropped by reason: {dropped}")
    cut = summary.truncated
    paired = "rejected" in summary.lengths  # else one completion per item (SFT, KTO)
    shown = {} if paired else {"chosen": "completion", "pair": "sequence"}
    completions = (
        f"chosen {cut['chosen']}, rejected {cut['rejected']}"
        if paired
        else f"completion {cut['chosen']}"
    )
    lines.append(
        f"  cut to fit: prompt {cut['prompt']} (oldest turns dropped "
        f"{cut['prompt_turns_dropped']}, "
        f"tokens cut {cut['prompt_tokens_cut']}), {completions}"
    )
    for name, count in sorted(summary.notes.items()):
        if name != "turns_dropped":  # counted with the cuts above
            lines.append(f"  {name}: {count} ({NOTES.get(name, 'see dpo_megatron.data')})")
    duplicates = summary.duplicates
    if duplicates.count:
        what = (
            "dropped (data.drop_duplicates=true)"
            if duplicates.dropped
            else "kept (data.drop_duplicates=true drops them)"
        )
        lines.append(
            f"  duplicates: {duplicates.count} {summary.unit} repeat an earlier "
            f"{summary.unit[:-1]}'s tokens, {what}; e.g. {'; '.join(duplicates.examples)}"
        )
    for stage, table in (
        ("lengths_before_cut", summary.lengths_before_cut),
        ("lengths", summary.lengths),
    ):
        for name, stats in table.items():
            text = " ".join(f"{k} {v}" for k, v in asdict(stats).items())
            lines.append(f"  {stage} {shown.get(name, name)} tokens: {text}")
    return "\n".join(lines)


def drop_warning(summary: DataSummary) -> str | None:
    """One ``WARNING:`` line when more than :data:`DROP_WARNING_SHARE` of the items a load met
    were dropped (a summary from the pipeline), naming the counts, each reason and the key that
    changes it; None otherwise."""
    dropped = summary.dropped
    lost = sum(dropped.values())
    total = lost + summary.kept
    if not total or lost / total <= DROP_WARNING_SHARE:
        return None
    reasons = "; ".join(
        f"{reason} {count}" + (f" ({DROP_REMEDIES[reason]})" if reason in DROP_REMEDIES else "")
        for reason, count in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    return (
        f"WARNING: {lost} of {total} {summary.unit} ({100 * lost / total:.0f}%) were "
        f"dropped: {reasons}"
    )
