"""The tokenized units the engine consumes: preference pairs (DPO) and prompt/answer examples
(SFT)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PreferencePair:
    """One prompt with a chosen and a rejected completion, as token ids.

    ``prompt_ids`` is what the model reads (BOS and chat-template tokens included, cut to
    ``max_prompt_length``); ``chosen_ids`` / ``rejected_ids`` are the completions the model
    would produce after it, each ending with exactly one EOS or end-of-turn token unless
    ``max_length`` cut it (then it ends where the cut fell). Both completions are non-empty.

    ``reference_chosen_logps`` / ``reference_rejected_logps`` ([len(chosen_ids)] and
    [len(rejected_ids)] fp32, nats) are the reference model's per-token log-probs of the
    completions when they were computed before training (``reference.mode=precomputed``): they
    travel with the pair into its micro-batch. Not part of equality.

    ``margin`` is the row's margin (its ``margin`` column), which a reward model's Bradley-Terry
    loss subtracts from the reward difference; None when the row has none.
    """

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    reference_chosen_logps: torch.Tensor | None = field(default=None, compare=False, repr=False)
    reference_rejected_logps: torch.Tensor | None = field(default=None, compare=False, repr=False)
    margin: float | None = None

    @property
    def target_ids(self) -> tuple[int, ...]:
        """The completion a sample of this prompt is shown against: the chosen one."""
        return self.chosen_ids


@dataclass(frozen=True)
class UnpairedPair(PreferencePair):
    """An unpaired example (KTO) laid out as a pair, so that every batch form (padded, packed, the
    precomputed reference) carries it as it carries pairs: ``chosen_ids`` is the example's
    completion, ``rejected_ids`` the completion of another example of the dataset (after this
    prompt: the mismatched pair of KTO's KL estimate, ``data.unpaired.with_kl_completions``), and
    ``desirable`` its label."""

    desirable: bool = True

    @property
    def completion_ids(self) -> tuple[int, ...]:
        """The example's own completion (laid out as ``chosen_ids``)."""
        return self.chosen_ids

    @property
    def kl_completion_ids(self) -> tuple[int, ...]:
        """Its KL completion: another example's completion after this prompt (laid out as
        ``rejected_ids``)."""
        return self.rejected_ids


@dataclass(frozen=True)
class UnpairedExample:
    """One prompt with one completion and its label (thumbs up: ``desirable``), as token ids."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    desirable: bool

    @property
    def target_ids(self) -> tuple[int, ...]:
        """The completion a sample of this prompt is shown against: its own."""
        return self.completion_ids


@dataclass(frozen=True)
class SFTExample:
    """One prompt with its target completion (the SFT view of a preference pair: the chosen
    side)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]

    @property
    def target_ids(self) -> tuple[int, ...]:
        """The completion a sample of this prompt is shown against: the target."""
        return self.completion_ids


@dataclass(frozen=True)
class LengthStats:
    """Percentiles and maximum of token lengths (nearest-rank, so every value is a real
    length; tokens)."""

    p50: int = 0
    p90: int = 0
    p99: int = 0
    max: int = 0


@dataclass(frozen=True)
class SourceSummary:
    """One source's line of the summary: its label and format, rows read, items kept and the
    drops by reason; ``role`` is ``train`` or ``eval`` (a separate eval set);
    ``first_dropped``: per reason, where its first item was dropped (``line 7``)."""

    label: str
    format: str
    rows_read: int
    kept: int
    dropped: dict[str, int]
    role: str
    first_dropped: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DuplicateReport:
    """Items that repeat an earlier item's tokens: how many, whether they were dropped
    (``data.drop_duplicates``) and up to three examples per source ("label: row N repeats
    row M")."""

    count: int = 0
    dropped: bool = True
    examples: tuple[str, ...] = ()


@dataclass
class DataSummary:
    """The summarise stage's result: what a load read, kept and dropped, printed at start-up
    (``data.summary.format_summary``) and kept with the dataset (``.summary``).

    Attributes:
        unit: what ``kept``, ``train`` and ``eval`` count (``pairs`` or ``examples``).
        rows_read: rows read over every source.
        kept: items kept over every source (train and eval).
        train, eval: items in the mixed training split and in the eval split.
        max_length, max_prompt_length: the limits the items were cut to (tokens).
        dropped: items dropped, by reason (``format_registry.Skip`` reasons and selection's).
        truncated: items cut to fit, by ``selection.TRUNCATION_KINDS`` (every kind present).
        notes: what conversion and encoding did, counted (``data.summary.NOTES``).
        duplicates: the repeated items.
        lengths_before_cut, lengths: token-length statistics per part (``prompt``, ``chosen``,
            ``rejected`` for a kind that reads it; after the cut also ``pair``: a pair's
            model-row tokens).
        sources: one line per source, training sources first.
        labels: unpaired examples only: desirable / undesirable counts of the training split.
    """

    unit: str
    rows_read: int
    kept: int
    train: int
    eval: int
    max_length: int
    max_prompt_length: int
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    duplicates: DuplicateReport = field(default_factory=DuplicateReport)
    lengths_before_cut: dict[str, LengthStats] = field(default_factory=dict)
    lengths: dict[str, LengthStats] = field(default_factory=dict)
    sources: list[SourceSummary] = field(default_factory=list)
    labels: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-ready values (for logs and files)."""
        return asdict(self)


@dataclass
class PreferenceDataset:
    """Pairs ready for batching: ``train`` and ``eval`` lists and the start-up ``summary`` (rows
    read, pairs kept, drops by reason, token-length percentiles; see ``summary.py``)."""

    train: list[PreferencePair]
    eval: list[PreferencePair]
    summary: DataSummary | None = None


@dataclass
class UnpairedDataset:
    """Unpaired examples ready for batching (as :class:`UnpairedPair`, each with its mismatched
    completion), with the same kind of summary as PreferenceDataset plus the label counts."""

    train: list[UnpairedPair]
    eval: list[UnpairedPair]
    summary: DataSummary | None = None


@dataclass
class SFTDataset:
    """SFT examples ready for batching, with the same kind of summary as PreferenceDataset."""

    train: list[SFTExample]
    eval: list[SFTExample]
    summary: DataSummary | None = None
