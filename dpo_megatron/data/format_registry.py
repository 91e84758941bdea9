"""Name -> row format registry, so that ``data.format`` (or the detection of ``auto``) selects a
converter, as ``loss.name`` selects a loss (``losses.registry``).

A format is one entry: a :class:`RowFormat` passed to :func:`register_format`, naming its
converter, the columns that identify its files, what its rows hold (a rejected side or not) and,
where several formats share their columns, the test on the first row that tells them apart. A
converter takes one raw row (a dict) and the options of :class:`ConvertOptions` (``DataConfig``
has them) and returns the :class:`Example` s the row makes; a malformed row raises
:class:`RowError` naming the field, a well-formed row that a format's own rule leaves out raises
:class:`Filtered` with the reason.

This module imports nothing of the package: the converters (``data.formats``) register into it.
Read the registry through ``data.formats``: importing it registers every built-in format, in
the order detection tries them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

Messages = list[dict]
Text = str | Messages

PAIRS = "pairs"
"""Rows with a chosen and a rejected answer (DPO and every paired loss; SFT reads the chosen)."""
COMPLETIONS = "completions"
"""Rows with one target answer and no rejected one (an SFT-only format, e.g. Alpaca)."""
UNPAIRED = "unpaired"
"""Rows with one completion and a desirable / undesirable label (KTO)."""
ROW_KINDS = (PAIRS, COMPLETIONS, UNPAIRED)


class RowError(ValueError):
    """A malformed row: ``field`` is the offending column (dotted for nested fields)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"field {field!r}: {message}")
        self.field = field


class Filtered(Exception):
    """A well-formed row that a rule leaves out; ``reason`` is the count's name in the summary."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Example:
    """One preference example before tokenization; ``rejected`` is None for SFT-only rows.

    ``notes`` name what a converter did that the summary counts without dropping the row
    (``diverged_early``: an HH pair split before its last turn). ``group`` names the post an
    SHP pair comes from, for ``data.shp_max_pairs_per_post`` (empty: no group)."""

    prompt: Text
    chosen: Text
    rejected: Text | None
    notes: tuple[str, ...] = ()
    group: str = ""
    label: bool | None = None
    """Unpaired rows (KTO): True for a desirable completion, False for an undesirable one; the
    completion is then ``chosen`` and ``rejected`` is None. None for pairs."""

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


class ConvertOptions(Protocol):
    """The ``data.*`` settings a converter reads (``DataConfig`` has them all)."""

    reference_preprocessing: bool
    shp_min_score_ratio: float
    se_max_pairs_per_question: int


Converter = Callable[[dict, ConvertOptions], list[Example]]


@dataclass(frozen=True)
class RowFormat:
    """One registered row format.

    Attributes:
        name: its ``data.format`` value.
        convert: the converter (row, options) -> examples.
        columns: columns every file of this format has; a file holding them all is of this
            format or of another entry with the same columns (told apart by ``matches``).
        holds: what its rows hold: :data:`PAIRS`, :data:`COMPLETIONS` (no rejected side: SFT
            only) or :data:`UNPAIRED` (a completion and a label: KTO).
        matches: (first row, columns) -> whether a file with ``columns`` is of this format;
            None: the columns decide.
    """

    name: str
    convert: Converter
    columns: frozenset[str]
    holds: str = PAIRS
    matches: Callable[[dict, set], bool] | None = None

    def __post_init__(self):
        object.__setattr__(self, "columns", frozenset(self.columns))

    @property
    def has_rejected(self) -> bool:
        """Whether the rows have a rejected answer."""
        return self.holds == PAIRS


FORMATS: dict[str, RowFormat] = {}
"""Every registered format by name, in registration order (the order detection tries them)."""


def register_format(fmt: RowFormat) -> RowFormat:
    """Register ``fmt`` (see :class:`RowFormat`); returns it.

    Detection (:func:`detect_format`) tries the formats' column sets in registration order and
    commits to the first set a file holds, so a format whose columns include another's
    (``prompt``, ``chosen``, ``rejected``) is registered before that one (``chosen``,
    ``rejected``).

    Raises:
        ValueError: the name is taken, or ``holds`` is not one of :data:`ROW_KINDS`.
    """
    if fmt.holds not in ROW_KINDS:
        raise ValueError(f"format {fmt.name!r}: holds={fmt.holds!r}; expected one of {ROW_KINDS}")
    if fmt.name in FORMATS:
        raise ValueError(f"data format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> RowFormat:
    """The registered format ``name``.

    Raises:
        ValueError: no such format (naming the known ones).
    """
    if name not in FORMATS:
        raise ValueError(f"data.format={name!r}; known formats: auto, {', '.join(sorted(FORMATS))}")
    return FORMATS[name]


def detect_format(columns: list[str], first_row: dict | None, label: str = "the data") -> str:
    """The format a dataset's columns (and first row's value types) imply; ``label`` names the
    dataset in the error. The first column set (registration order) the columns hold decides
    the candidates; among formats with that set, the first row's ``matches`` decides.

    Raises ValueError naming the dataset and its columns when no format or more than one fits.
    """
    cols = set(columns)
    row = first_row or {}
    candidates: list[str] = []
    for group in dict.fromkeys(f.columns for f in FORMATS.values()):
        if group <= cols:
            candidates = [
                f.name
                for f in FORMATS.values()
                if f.columns == group and (f.matches is None or f.matches(row, cols))
            ]
            break
    if len(candidates) != 1:
        raise ValueError(
            f"cannot tell the data format of {label} from its columns {sorted(cols)}"
            f"{_nearest_formats(cols) if not candidates else ''}: set data.format to one of "
            f"{sorted(FORMATS)}"
        )
    return candidates[0]


def _nearest_formats(cols: set[str]) -> str:
    """The formats whose columns the file comes nearest to holding, and the columns it lacks
    (a misspelt key such as ``response`` for ``completion``): fewest missing, then most shared,
    then most missing ones that a column's name contains (``chosen`` in ``chosen_response``);
    "" when no format shares a column with it."""

    def named_alike(group: frozenset[str]) -> int:
        return sum(any(m.lower() in c.lower() for c in cols) for m in group - cols)

    groups = [g for g in dict.fromkeys(f.columns for f in FORMATS.values()) if g & cols]
    if not groups:
        return ""
    best = min(groups, key=lambda g: (len(g - cols), -len(g & cols), -named_alike(g)))
    names = " / ".join(repr(f.name) for f in FORMATS.values() if f.columns == best)
    return f"; nearest: {names}, which also need {sorted(best - cols)}"
