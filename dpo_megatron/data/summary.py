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
        what = "dropped (data.drop_duplicates=true)" if duplicates["dropped"] else "kept (data.drop_duplicates=true drops them)"
        lines.append(
            f"  duplicates: {duplicates['count']} pairs repeat an earlier pair's tokens, {what}; "
            f"e.g. {'; '.join(duplicates['examples'])}"
        )
    for stage in ("lengths_before_cut", "lengths"):
        for name, stats in summary[stage].items():
            text = " ".join(f"{k} {v}" for k, v in stats.items())
            lines.append(f"  {stage} {name} tokens: {text}")
    return "\n".join(lines)
