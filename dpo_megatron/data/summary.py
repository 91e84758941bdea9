"""The start-up summary of a data load: counts, drops by reason, token-length percentiles."""

from __future__ import annotations

from typing import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


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
        lines.append(
            f"  {source['label']} ({source['format']}): {source['rows_read']} rows, "
            f"{source['pairs_kept']} kept, dropped: {dropped}"
        )
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(summary["dropped"].items())) or "none"
    lines.append(f"  dropped by reason: {dropped}")
    cut = summary["truncated"]
    lines.append(f"  cut to fit: prompt {cut['prompt']}, chosen {cut['chosen']}, rejected {cut['rejected']}")
    for stage in ("lengths_before_cut", "lengths"):
        for name, stats in summary[stage].items():
            text = " ".join(f"{k} {v}" for k, v in stats.items())
            lines.append(f"  {stage} {name} tokens: {text}")
    return "\n".join(lines)
