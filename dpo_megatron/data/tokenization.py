"""Tokenize stage: a :class:`~dpo_megatron.data.read.ReadSource` -> :class:`TokenizedSource`, one
:class:`TokenizedRow` per example a row makes (or per row dropped or malformed), cached on disk.

Every row is converted (its format's converter) and encoded (``encode.encode_example``) in a
``datasets.map`` of ``data.num_proc`` workers; the result is stored under the key of
``cache.tokenization_cache_key`` and read back from there when the key matches. Malformed rows
then stop the load or are counted (``read.check_row_errors``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dpo_megatron.data.cache import (
    cache_folder,
    load_cached,
    save_atomically,
    tokenization_cache_key,
)
from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.encode import EncodeSettings, TokenBudget, encode_example
from dpo_megatron.data.formats import Filtered, RowError, get_format
from dpo_megatron.data.kinds import ItemKind
from dpo_megatron.data.read import ReadSource, check_row_errors
from dpo_megatron.data.sources import JSON_COLUMN, WHERE_COLUMN

NAN = float("nan")
NO_LABEL = -1
"""``TokenizedRow.label`` of a row without one (a pair)."""
MARGIN_COLUMN = "margin"
"""An optional per-row number: the margin a reward model's Bradley-Terry loss subtracts from the
pair's reward difference (``losses.reward``; TRL's ``margin`` column), for every pair the row
makes."""


@dataclass(slots=True)
class TokenizedRow:
    """One example's token ids before the token cuts (``selection``), or a row left out.

    Attributes:
        where: the row's location in its source (``line 3``, ``row 7``).
        prompt_ids, chosen_ids: token ids (empty for a row left out).
        rejected_ids: token ids of the rejected side (empty when none was tokenized).
        drop: the reason the row is left out (``Filtered.reason``, or ``malformed``); empty
            for an example.
        error: ``"<source>: <where>: <error>"`` of a malformed row, else empty.
        prompt_length_uncut: the prompt's tokens before whole turns were dropped.
        notes: what conversion and encoding did (``turns_dropped``, ``diverged_early`` ...).
        group: the post an SHP pair comes from (empty: none).
        label: 1 desirable, 0 undesirable (unpaired rows), :data:`NO_LABEL` for a pair.
        margin: the row's :data:`MARGIN_COLUMN` value, NaN when it has none.
    """

    where: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    drop: str
    error: str
    prompt_length_uncut: int
    notes: list[str]
    group: str
    label: int
    margin: float


@dataclass
class TokenizedSource:
    """A source's tokenized rows, in file order (a row may make several, or one left out)."""

    read: ReadSource
    rows: list[TokenizedRow]


def _features():
    import datasets

    return datasets.Features(
        {
            "where": datasets.Value("string"),
            "prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "chosen_ids": datasets.Sequence(datasets.Value("int32")),
            "rejected_ids": datasets.Sequence(datasets.Value("int32")),
            "drop": datasets.Value("string"),
            "error": datasets.Value("string"),
            "prompt_length_uncut": datasets.Value("int64"),
            "notes": datasets.Sequence(datasets.Value("string")),
            "group": datasets.Value("string"),
            "label": datasets.Value("int8"),
            "margin": datasets.Value("float64"),
        }
    )


FIELDS = tuple(TokenizedRow.__dataclass_fields__)
"""The cached columns: one per :class:`TokenizedRow` field, same names."""


def _tokenize_batch(
    batch: dict, indices: list[int], *, fmt, cfg_dict, tokenizer, settings, label, reads_rejected
) -> dict:
    """``datasets.map`` worker: rows -> the columns of one :class:`TokenizedRow` per example or
    per dropped/bad row."""
    cfg = DataConfig(**cfg_dict)
    convert = get_format(fmt).convert
    budget = TokenBudget(cfg.max_length, cfg.max_prompt_length, cfg.truncation_mode)
    out: dict[str, list] = {name: [] for name in FIELDS}

    def emit(where, encoded=None, drop="", error="", group="", row_label=None, margin=NAN):
        row = TokenizedRow(
            where,
            list(encoded.prompt_ids) if encoded else [],
            list(encoded.chosen_ids) if encoded else [],
            list(encoded.rejected_ids or []) if encoded else [],
            drop,
            error,
            encoded.prompt_length_uncut if encoded else 0,
            list(encoded.notes) if encoded else [],
            group,
            NO_LABEL if row_label is None else int(row_label),
            margin,
        )
        for name in FIELDS:
            out[name].append(getattr(row, name))

    columns = [c for c in batch if c not in (JSON_COLUMN, WHERE_COLUMN)]
    for k, index in enumerate(indices):
        if JSON_COLUMN in batch:
            row, where = json.loads(batch[JSON_COLUMN][k]), batch[WHERE_COLUMN][k]
        else:
            row, where = {c: batch[c][k] for c in columns}, f"row {index}"
        try:
            margin = row_margin(row)
            for example in convert(row, cfg):
                if not reads_rejected:
                    example = replace(example, rejected=None)
                try:
                    emit(
                        where,
                        encode_example(example, tokenizer, settings, budget),
                        group=example.group,
                        row_label=example.label,
                        margin=margin,
                    )
                except Filtered as f:
                    emit(where, drop=f.reason)
        except Filtered as f:
            emit(where, drop=f.reason)
        except RowError as e:
            emit(where, drop="malformed", error=f"{label}: {where}: {e}")
    return out


def row_margin(row: dict) -> float:
    """The row's :data:`MARGIN_COLUMN` as a float, NaN when absent or null.

    Raises:
        RowError: a margin that is not a finite number.
    """
    value = row.get(MARGIN_COLUMN) if isinstance(row, dict) else None
    if value is None:
        return NAN
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError(MARGIN_COLUMN, f"expected a finite number, got {value!r}")
    return float(value)


def _decode(tokenized) -> list[TokenizedRow]:
    """The :class:`TokenizedRow` s of a tokenized (or cached) ``datasets.Dataset``."""
    return [TokenizedRow(*values) for values in zip(*(tokenized[name] for name in FIELDS))]


def tokenize_source(
    read: ReadSource, tokenizer, settings: EncodeSettings, cfg: DataConfig, kind: ItemKind
) -> TokenizedSource:
    """The tokenized rows of one source, from the cache when the key matches.

    Raises:
        DataError: malformed rows, per ``read.check_row_errors``.
    """
    import datasets

    key = tokenization_cache_key(read, tokenizer, settings, cfg, kind)
    folder = cache_folder(cfg, key)
    tokenized = load_cached(folder)
    if tokenized is None:
        source = read.source
        quiet = not cfg.verbose and datasets.is_progress_bar_enabled()
        if quiet:
            datasets.disable_progress_bars()
        try:
            tokenized = source.dataset.map(
                _tokenize_batch,
                batched=True,
                batch_size=64,
                with_indices=True,
                num_proc=cfg.num_proc if cfg.num_proc > 1 and len(source.dataset) > 64 else None,
                remove_columns=source.dataset.column_names,
                features=_features(),
                fn_kwargs=dict(
                    fmt=read.format.name,
                    cfg_dict=asdict(cfg),
                    tokenizer=tokenizer,
                    settings=settings,
                    label=source.label,
                    reads_rejected=kind.reads_rejected,
                ),
                new_fingerprint=key[:32],  # our key: spares datasets from hashing the tokenizer
                load_from_cache_file=False,
                desc=f"tokenizing {Path(source.label).name}",
            )
            if folder is not None:
                save_atomically(tokenized, folder)
        finally:
            if quiet:
                datasets.enable_progress_bars()
    rows = _decode(tokenized)
    errors = [row.error for row in rows if row.error]
    fitting = sum(1 for row in rows if row.drop != "malformed")
    check_row_errors(read, errors, fitting, cfg.on_error)
    return TokenizedSource(read, rows)
