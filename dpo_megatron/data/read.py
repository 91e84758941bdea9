"""Read stage: a configured source -> :class:`ReadSource` (its raw rows and its row format), and
the row-error policy.

Each source is read (``sources``: files, folders, hub names) and its format resolved: the
configured one, or for ``auto`` the one its columns imply (``format_registry.detect_format``),
checked against the item kind the loss trains on (``kinds.ItemKind.check_format``). Malformed rows
stop the load with file, row and field (``data.on_error=raise``) or are counted (``skip``); a
source none of whose rows fits its format stops it either way, naming the format its columns
fit (:func:`check_row_errors`).

:func:`check_sources` runs this stage and the conversion of every row without a tokenizer, over
the training and the eval sources: the launchers' pre-check, so that a missing file or a row that
does not fit its format is reported before any rank starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from dpo_megatron.data.config import DataConfig, as_data_config
from dpo_megatron.data.formats import Filtered, RowError, RowFormat, detect_format, get_format
from dpo_megatron.data.kinds import PAIRS_KIND, ItemKind
from dpo_megatron.data.sources import (
    JSON_COLUMN,
    WHERE_COLUMN,
    DataError,
    Source,
    is_local_source,
    read_source,
)


@dataclass
class ReadSource:
    """One source's raw rows and their format.

    Attributes:
        source: the rows (``sources.Source``: label, ``datasets.Dataset``, malformed count,
            files).
        format: its row format (resolved from ``auto``).
        index: its position in ``data.datasets`` (or ``data.eval_datasets``): seeds its eval
            split.
        role: ``train`` (a training source, whose eval share may be split off) or ``eval`` (a
            source of ``data.eval_datasets``).
    """

    source: Source
    format: RowFormat
    index: int = 0
    role: str = "train"

    @property
    def label(self) -> str:
        """The source's name in messages and the summary."""
        return self.source.label


def read(
    index: int, name: str, fmt: str, split: str, cfg: DataConfig, kind: ItemKind, role: str
) -> ReadSource:
    """Read source ``name`` (at ``split``) and resolve its format ``fmt`` for ``kind``.

    Raises:
        DataError: see :func:`sources.read_source` and :func:`resolve_format`.
    """
    source = read_source(name, split, cfg.on_error)
    return ReadSource(source, resolve_format(source, fmt, kind), index, role)


def resolve_format(source: Source, fmt: str, kind: ItemKind) -> RowFormat:
    """The format of a source: ``fmt``, or detected from its columns for ``auto``.

    Raises:
        DataError: the source has no rows, its format cannot be told from its columns (naming
            the source), or ``kind`` cannot train on its rows (``ItemKind.check_format``).
    """
    if len(source.dataset) == 0:
        raise DataError(f"{source.label}: no rows")
    try:
        if fmt == "auto":
            fmt = detect_format(columns(source), first_row(source), source.label)
        row_format = get_format(fmt)
    except ValueError as e:
        raise DataError(str(e)) from None
    kind.check_format(row_format, source.label)
    return row_format


def rows(source: Source) -> Iterator[tuple[str, dict]]:
    """(location, row dict) of every row of a source."""
    if JSON_COLUMN in source.dataset.column_names:
        for where, text in zip(source.dataset[WHERE_COLUMN], source.dataset[JSON_COLUMN]):
            yield where, json.loads(text)
    else:
        for index, row in enumerate(source.dataset):
            yield f"row {index}", row


def columns(source: Source) -> list[str]:
    """The columns of a source's rows (a JSON file's: its first row's keys)."""
    if JSON_COLUMN in source.dataset.column_names:
        return list(json.loads(source.dataset[0][JSON_COLUMN]).keys())
    return list(source.dataset.column_names)


def first_row(source: Source) -> dict:
    """A source's first row as a dict."""
    row = source.dataset[0]
    return json.loads(row[JSON_COLUMN]) if JSON_COLUMN in row else row


def check_row_errors(read: ReadSource, errors: list[str], fitting: int, on_error: str) -> None:
    """Stop on malformed rows: always when no row fits the source's format (naming the format
    its columns fit instead: skipping would drop every row), else per ``data.on_error``.

    Args:
        errors: one message per malformed row (``"<label>: <where>: <error>"``), file order.
        fitting: rows that parsed as the format (kept or filtered).

    Raises:
        DataError: as above.
    """
    if not errors:
        return
    source, fmt = read.source, read.format.name
    if fitting == 0:
        try:
            looks = detect_format(columns(source), first_row(source), source.label)
            hint = (
                f"its columns {sorted(columns(source))} look like format {looks!r}: set "
                f"data.format={looks} (or auto)"
                if looks != fmt
                else f"its columns look like {fmt!r} but no row parses as one"
            )
        except ValueError:
            hint = f"its columns {sorted(columns(source))} fit no known format"
        raise DataError(
            f"{source.label}: no row fits data.format={fmt!r} (first: "
            f"{errors[0].removeprefix(source.label + ': ')}); {hint}"
        )
    if on_error == "raise":
        more = f" (and {len(errors) - 1} more bad rows)" if len(errors) > 1 else ""
        raise DataError(errors[0] + more + "; set data.on_error=skip to drop and count them")


def check_sources(cfg: DataConfig, kind: ItemKind = PAIRS_KIND) -> list[tuple[str, str]]:
    """[(source, format)] after reading every local source, training (``data.split``) then eval
    (``data.eval_datasets`` at ``data.eval_split``), and converting each of its rows (no
    tokenizer) for the item ``kind``: what the load would refuse before tokenizing, refused
    here. Hub names are not read (they need the network); the load checks them.

    Raises:
        DataError: as the load would, with the same messages.
    """
    cfg = as_data_config(cfg)
    out = []
    for (name, fmt), split in [(s, cfg.split) for s in cfg.sources()] + [
        (s, cfg.eval_split) for s in cfg.eval_sources()
    ]:
        if not is_local_source(name):
            out.append((name, fmt))
            continue
        source = read(0, name, fmt, split, cfg, kind, "train")
        errors, converted = [], 0
        for where, row in rows(source.source):
            try:
                source.format.convert(row, cfg)
                converted += 1
            except Filtered:
                converted += 1
            except RowError as e:
                errors.append(f"{source.label}: {where}: {e}")
        check_row_errors(source, errors, converted, cfg.on_error)
        out.append((source.label, source.format.name))
    return out
