"""The tokenized units the engine consumes: preference pairs (DPO) and prompt/answer examples
(SFT)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

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
    reference_chosen_logps: Optional["torch.Tensor"] = field(
        default=None, compare=False, repr=False
    )
    reference_rejected_logps: Optional["torch.Tensor"] = field(
        default=None, compare=False, repr=False
    )
    margin: Optional[float] = None

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


@dataclass
class PreferenceDataset:
    """Pairs ready for batching: ``train`` and ``eval`` lists and the start-up ``summary`` (rows
    read, pairs kept, drops by reason, token-length percentiles; see ``summary.py``)."""

    train: list[PreferencePair]
    eval: list[PreferencePair]
    summary: dict = field(default_factory=dict)


@dataclass
class UnpairedDataset:
    """Unpaired examples ready for batching (as :class:`UnpairedPair`, each with its mismatched
    completion), with the same kind of summary as PreferenceDataset plus the label counts."""

    train: list[UnpairedPair]
    eval: list[UnpairedPair]
    summary: dict = field(default_factory=dict)


@dataclass
class SFTDataset:
    """SFT examples ready for batching, with the same kind of summary as PreferenceDataset."""

    train: list[SFTExample]
    eval: list[SFTExample]
    summary: dict = field(default_factory=dict)
