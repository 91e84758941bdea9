"""The start-up summary of a data load: counts, drops by reason, token-length percentiles."""

from __future__ import annotations

from typing import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)

NOTES = {
    "diverged_early": "HH dialogues that differ before their last turn, split after their last "
    "common '\\n\\nAssistant:' (completions of several turns)",
    "prompt_ends_with_space": "text prompts ending in a space (a lone space token at the "
    "prompt/completion boundary)",
    "text_bounded": "examples with a text far over the length limits, cut before tokenizing",
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


def length_stats(lengths: Sequence[int]) -> dict[str, int]:
    """{"p50", "p90", "p99", "max"} of token lengths (nearest-rank, so values are real lengths)."""
    if len(lengths) == 0:
        return {f"p{q}": 0 for q in PERCENTILES} | {"max": 0}
    values = np.asarray(lengths)
    out = {f"p{q}": int(np.percentile(values, q, method="inverted_cdf")) for q in PERCENTILES}
    out["max"] = int(values.max())
    return out


def format_summary(summary: dict) -> str:
    """Human-readable multi-line text of a summary dict built by the pipeline."""
    lines = [
        f"data: {summary['rows_read']} rows read, {summary['pairs_kept']} {summary['unit']} kept "
        f"({summary['train']} train, {summary['eval']} eval), max_length {summary['max_length']}, "
        f"max_prompt_length {summary['max_prompt_length']}"
    ]
    for source in summary["sources"]:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(source["dropped"].items())) or "none"
        role = "eval set " if source.get("role") == "eval" else ""
        lines.append(
            f"  {role}{source['label']} ({source['format']}): {source['rows_read']} rows, "
            f"{source['pairs_kept']} kept, dropped: {dropped}"
        )
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(summary["dropped"].items())) or "none"
    lines.append(f"  dropped by reason: {dropped}")
    cut = summary["truncated"]
    lines.append(
        f"  cut to fit: prompt {cut['prompt']} (oldest turns dropped {cut['prompt_turns_dropped']}, "
        f"tokens cut {cut['prompt_tokens_cut']}), chosen {cut['chosen']}, "
        f"rejected {cut['rejected']}"
    )
    for name, count in sorted(summary.get("notes", {}).items()):
        if name != "turns_dropped":  # counted with the cuts above
            lines.append(f"  {name}: {count} ({NOTES.get(name, 'see dpo_megatron.data')})")
    duplicates = summary.get("duplicates", {})
    if duplicates.get("count"):
        what = (
            "dropped (data.drop_duplicates=true)"
            if duplicates["dropped"]
            else "kept (data.drop_duplicates=true drops them)"
        )
        lines.append(
            f"  duplicates: {duplicates['count']} pairs repeat an earlier pair's tokens, {what}; "
            f"e.g. {'; '.join(duplicates['examples'])}"
        )
    for stage in ("lengths_before_cut", "lengths"):
        for name, stats in summary[stage].items():
            text = " ".join(f"{k} {v}" for k, v in stats.items())
            lines.append(f"  {stage} {name} tokens: {text}")
    return "\n".join(lines)


def drop_warning(summary: dict) -> str | None:
    """One ``WARNING:`` line when more than :data:`DROP_WARNING_SHARE` of the items a load met
    were dropped (a summary from the pipeline), naming the counts, each reason and the key that
    changes it; None otherwise."""
    dropped = summary["dropped"]
    lost = sum(dropped.values())
    total = lost + summary["pairs_kept"]
    if not total or lost / total <= DROP_WARNING_SHARE:
        return None
    reasons = "; ".join(
        f"{reason} {count}" + (f" ({DROP_REMEDIES[reason]})" if reason in DROP_REMEDIES else "")
        for reason, count in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    return (
        f"WARNING: {lost} of {total} {summary['unit']} ({100 * lost / total:.0f}%) were "
        f"dropped: {reasons}"
    )
