"""Select stage: a :class:`~dpo_megatron.data.tokenization.TokenizedSource` -> the items kept
(:class:`SelectedSource`), and the mix of several sources' training items.

Per source, in file order: rows left out by conversion or encoding are counted by reason; the
per-post cap applies (SHP: ``data.shp_max_pairs_per_post``); duplicates are counted (and dropped
with ``data.drop_duplicates``); the length limits cut or drop (``lengths.fit_lengths``); each
kept row becomes an item of the loss's kind (``kinds.ItemKind.make_item``); and the source's eval
share (``data.eval_fraction``) is split off by ``data.seed``. :func:`mix` then joins the
training sources by ``data.weights``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.formats import Filtered
from dpo_megatron.data.kinds import ItemKind
from dpo_megatron.data.lengths import fit_lengths
from dpo_megatron.data.sources import DataError
from dpo_megatron.data.tokenization import NO_LABEL, TokenizedSource

TRUNCATION_KINDS = ("prompt", "prompt_turns_dropped", "prompt_tokens_cut", "chosen", "rejected")
"""What the summary counts as cut to fit (``SelectedSource.truncated``)."""


@dataclass
class Lengths:
    """Token lengths of a source's items, one entry per item (rejected: pairs only)."""

    prompt: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)


@dataclass
class SelectedSource:
    """One source after selection.

    Attributes:
        label, format, role: the source's name, format name and role (``train`` / ``eval``).
        rows_read: rows read (malformed lines skipped by the reader included).
        dropped: items left out, by reason.
        first_dropped: per reason, where its first item was left out (``line 7``, ``row 3``):
            the summary names it, so a dropped row can be found.
        truncated: items cut to fit, by :data:`TRUNCATION_KINDS`.
        notes: what conversion and encoding did, counted (``Example.notes``).
        duplicates: (where, where it repeats) of each item whose tokens repeat an earlier one's.
        lengths_before: the kept items' lengths before the token cuts (the prompt's before
            whole turns were dropped).
        lengths: the kept items' lengths after the cuts (``rejected``: 0 without a rejected
            side).
        pair_lengths: per kept item, prompt + the longer completion (tokens).
        kept: the kept items (of the kind's class), file order; ``train`` and ``eval`` split
            them (eval: ``data.eval_fraction`` of them, none for an eval source's role).
    """

    label: str
    format: str
    role: str
    rows_read: int
    dropped: Counter
    first_dropped: dict[str, str]
    truncated: Counter
    notes: Counter
    duplicates: list[tuple[str, str]]
    lengths_before: Lengths
    lengths: Lengths
    pair_lengths: list[int]
    kept: list
    train: list
    eval: list


def select_source(
    tokenized: TokenizedSource, cfg: DataConfig, kind: ItemKind, bos_token_id: int | None
) -> SelectedSource:
    """The items kept of one source (see the module doc). ``bos_token_id``: a BOS that the
    tokenizer puts first, kept through every prompt cut (None: none).

    A template's first special token (e.g. ChatML's ``<|im_start|>``, reported as "BOS" by
    SmolLM2) is cut like any token: pass the BOS only when the tokenizer adds it.
    """
    read = tokenized.read
    source = read.source
    rejected = kind.reads_rejected
    dropped: Counter = Counter()
    first_dropped: dict[str, str] = {}
    if source.malformed:
        dropped["malformed"] += source.malformed

    def drop(reason: str, where: str) -> None:
        dropped[reason] += 1
        first_dropped.setdefault(reason, where)

    kept: list = []
    before, after, pair_lengths = Lengths(), Lengths(), []
    truncated: Counter = Counter()
    notes: Counter = Counter()
    first_seen: dict[tuple, str] = {}
    duplicates: list[tuple[str, str]] = []
    rows = set()
    cap = cfg.shp_max_pairs_per_post if read.format.name == "shp" else 0
    per_group: Counter = Counter()  # kept items so far of each group (an SHP post)
    for row in tokenized.rows:
        rows.add(row.where)
        if row.drop:
            drop(row.drop, row.where)
            continue
        if cap and row.group:
            per_group[row.group] += 1
            if per_group[row.group] > cap:
                drop("shp_pairs_per_post", row.where)
                continue
        notes.update(row.notes)
        p, c, r = row.prompt_ids, row.chosen_ids, row.rejected_ids
        key = (tuple(p), tuple(c), tuple(r) if rejected else (), row.label)
        if key in first_seen:
            duplicates.append((row.where, first_seen[key]))
            if cfg.drop_duplicates:
                drop("duplicate", row.where)
                continue
        else:
            first_seen[key] = row.where
        before.prompt.append(row.prompt_length_uncut)
        before.chosen.append(len(c))
        if rejected:
            before.rejected.append(len(r))
        try:
            fp, fc, fr = fit_lengths(p, c, r if rejected else None, cfg, bos_token_id)
        except Filtered as f:
            drop(f.reason, row.where)
            continue
        turns = "turns_dropped" in row.notes
        truncated["prompt"] += turns or len(fp) < len(p)
        truncated["prompt_turns_dropped"] += turns
        truncated["prompt_tokens_cut"] += len(fp) < len(p)
        truncated["chosen"] += len(fc) < len(c)
        truncated["rejected"] += rejected and len(fr) < len(r)
        fr = tuple(fr) if rejected else ()
        after.prompt.append(len(fp))
        after.chosen.append(len(fc))
        after.rejected.append(len(fr))
        pair_lengths.append(len(fp) + max(len(fc), len(fr)))
        label = None if row.label == NO_LABEL else bool(row.label)
        margin = None if math.isnan(row.margin) else row.margin
        kept.append(kind.make_item(tuple(fp), tuple(fc), fr if rejected else None, label, margin))

    n_eval = int(round(cfg.eval_fraction * len(kept)))
    if cfg.eval_fraction > 0 and len(kept) >= 2:
        n_eval = min(max(n_eval, 1), len(kept) - 1)
    order = np.random.default_rng([cfg.seed, read.index]).permutation(len(kept))
    eval_idx = set(order[:n_eval].tolist())
    return SelectedSource(
        label=source.label,
        format=read.format.name,
        role=read.role,
        rows_read=len(rows) + source.malformed,
        dropped=dropped,
        first_dropped=first_dropped,
        truncated=truncated,
        notes=notes,
        duplicates=duplicates,
        lengths_before=before,
        lengths=after,
        pair_lengths=pair_lengths,
        kept=kept,
        train=[x for i, x in enumerate(kept) if i not in eval_idx],
        eval=[x for i, x in enumerate(kept) if i in eval_idx],
    )


def mix(trains: list[list], cfg: DataConfig) -> list:
    """Concatenate the sources' training items, resized to ``cfg.weights`` proportions if given
    (source i makes ``round(total * w_i / sum(w))`` items, drawn by ``data.seed``, repeating a
    short source).

    Raises:
        DataError: a source with a positive weight kept no item.
    """
    if not cfg.weights or len(trains) == 1:
        return [x for t in trains for x in t]
    total = sum(len(t) for t in trains)
    weight_sum = float(sum(cfg.weights))
    out = []
    for i, (items, weight) in enumerate(zip(trains, cfg.weights)):
        n = int(round(total * weight / weight_sum))
        if n and not items:
            raise DataError(f"data.datasets[{i}] kept no pairs but has weight {weight}")
        if n == 0:
            continue
        rng = np.random.default_rng([cfg.seed, 1_000_003, i])
        full, rest = divmod(n, len(items))
        idx = list(range(len(items))) * full + sorted(
            rng.choice(len(items), rest, replace=False).tolist()
        )
        out.extend(items[j] for j in idx)
    return out
