"""The kind of item a loss trains on, chosen once from the loss (``LossFunction.item_kind``).

An :class:`ItemKind` carries everything that differs between preference pairs (DPO and every
paired loss), a reward model's pairs, SFT examples (a loss that reads no rejected completion) and
unpaired examples (KTO): which row formats it reads, whether the rejected side is tokenized, cut
and kept, the item class the data path makes (and its dataset class), the unit the summary and
the logs count, and the batch builder of its unpacked micro-batches. Its name also names its
micro-batches' targets (``data.targets``, ``losses.targets``), which the loss dispatches on. The
data path and the trainer take the kind and ask it; nothing threads a boolean.

No torch here (the launchers' pre-check reads the kinds): the batch builders are named, and
``data.builders`` makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpo_megatron.data.format_registry import COMPLETIONS, FORMATS, PAIRS, UNPAIRED, RowFormat
from dpo_megatron.data.pairs import (
    DataSummary,
    PreferenceDataset,
    PreferencePair,
    SFTDataset,
    SFTExample,
    UnpairedDataset,
    UnpairedExample,
    UnpairedPair,
)
from dpo_megatron.data.sources import DataError
from dpo_megatron.data.unpaired import label_counts, with_kl_completions


@dataclass(frozen=True)
class ItemKind:
    """One kind of item (see the module doc).

    Attributes:
        name: the loss's ``item_kind``: ``pairs``, ``reward``, ``sft`` or ``unpaired`` (the
            targets' kind, ``data.targets.TARGET_MAKERS``).
        item_class: the class of the items a load returns.
        dataset_class: the class of the load's result (``train``, ``eval``, ``summary``).
        unit: what the summary and the logs count (``pairs`` or ``examples``).
        reads: the row kinds (``format_registry.RowFormat.holds``) whose formats it reads.
        reads_rejected: whether a row's rejected side is tokenized, cut and kept.
        sequences_per_item: model rows per item in a padded micro-batch (2: a pair's chosen and
            rejected, or an unpaired example's completion and mismatched completion; 1: SFT).
        builder: the ``data.collate`` class of its unpacked micro-batches.
    """

    name: str
    item_class: type
    dataset_class: type
    unit: str
    reads: frozenset[str]
    reads_rejected: bool
    sequences_per_item: int
    builder: str

    def check_format(self, fmt: RowFormat, label: str) -> None:
        """Raise DataError (naming the source ``label``) when this kind cannot train on rows of
        ``fmt``: an SFT-only format for a paired loss, pairs for an unpaired loss, unpaired rows
        for a paired one."""
        if fmt.holds in self.reads:
            return
        if fmt.holds == COMPLETIONS:
            raise DataError(
                f"{label}: format {fmt.name!r} has no rejected answers; it serves the "
                f"SFT stage only (loss.name=sft)"
            )
        if UNPAIRED in self.reads:
            unpaired = sorted(f.name for f in FORMATS.values() if f.holds == UNPAIRED)
            raise DataError(
                f"{label}: format {fmt.name!r} holds pairs; an unpaired loss (kto) reads "
                f"rows with a completion and a label: {', '.join(unpaired)}"
            )
        raise DataError(
            f"{label}: format {fmt.name!r} holds unpaired rows (a completion and a "
            f"label): train on it with loss.name=kto"
        )

    def check_packing(self, packing, trains: str = "an SFT loss") -> None:
        """Refuse packing for a kind of one sequence per item: the packed builders lay out two
        (a pair's answers, KTO's example and its KL sequence). ``packing``: the ``packing``
        config section or None; ``trains``: who trains on single completions, for the message.

        Raises:
            ValueError: ``packing.enabled`` or ``packing.share_prompt`` true for such a kind.
        """
        if packing is None or self.sequences_per_item == 2:
            return
        for key in ("enabled", "share_prompt"):
            if getattr(packing, key):
                raise ValueError(
                    f"packing.{key}=true packs preference pairs; {trains} trains on single "
                    f"completions (SFT): set packing.{key}=false or leave it unset (auto: off)"
                )

    def make_item(
        self,
        prompt_ids: tuple[int, ...],
        chosen_ids: tuple[int, ...],
        rejected_ids: tuple[int, ...] | None,
        label: bool | None,
        margin: float | None = None,
    ):
        """One kept item of this kind from its (cut) token ids; ``chosen_ids`` is the target
        completion of SFT and unpaired rows, ``label`` their desirability (unpaired only),
        ``margin`` a pair's row's margin (``data.tokenization.MARGIN_COLUMN``; pairs only)."""
        if self.reads_rejected:
            return PreferencePair(prompt_ids, chosen_ids, rejected_ids, margin=margin)
        return SFTExample(prompt_ids, chosen_ids)

    def finish(self, items: Sequence, max_length: int) -> list:
        """The items of one split (train or eval) as the engine trains on them."""
        return list(items)

    def dataset(self, train: list, eval_: list, summary: DataSummary, verbose: bool = False):
        """The load's result (``dataset_class``); ``verbose``: print what the kind adds to the
        summary."""
        return self.dataset_class(train, eval_, summary)


@dataclass(frozen=True)
class UnpairedKind(ItemKind):
    """Unpaired examples (KTO): each finished with the mismatched completion of KTO's KL
    estimate (``data.unpaired.with_kl_completions``, within its split), and the summary adds
    ``labels`` (desirable / undesirable counts of the training split)."""

    def make_item(
        self, prompt_ids, chosen_ids, rejected_ids, label, margin=None
    ) -> UnpairedExample:
        """An :class:`UnpairedExample` (``chosen_ids`` is its completion)."""
        return UnpairedExample(prompt_ids, chosen_ids, bool(label))

    def finish(self, items: Sequence[UnpairedExample], max_length: int) -> list[UnpairedPair]:
        """Each example as an :class:`UnpairedPair` with its mismatched completion."""
        return with_kl_completions(items, max_length)

    def dataset(self, train: list, eval_: list, summary: DataSummary, verbose: bool = False):
        """The :class:`UnpairedDataset`, its summary with ``labels``."""
        summary.labels = label_counts(train)
        if verbose:
            print(
                f"labels (train): {summary.labels['desirable']} desirable, "
                f"{summary.labels['undesirable']} undesirable",
                flush=True,
            )
        return UnpairedDataset(train, eval_, summary)


PAIRS_KIND = ItemKind(
    "pairs",
    PreferencePair,
    PreferenceDataset,
    "pairs",
    frozenset({PAIRS}),
    reads_rejected=True,
    sequences_per_item=2,
    builder="PaddedPairs",
)
"""Preference pairs (DPO and every paired loss)."""

REWARD_KIND = replace(PAIRS_KIND, name="reward")
"""A reward model's preference pairs: read, kept and batched as pairs; their targets
(``RewardTargets``) score one reward per sequence."""

SFT_KIND = ItemKind(
    "sft",
    SFTExample,
    SFTDataset,
    "examples",
    frozenset({PAIRS, COMPLETIONS}),
    reads_rejected=False,
    sequences_per_item=1,
    builder="SFTExamples",
)
"""SFT examples: prompt + chosen of a pair, or an SFT-only row's answer (no rejected read)."""

UNPAIRED_KIND = UnpairedKind(
    "unpaired",
    UnpairedPair,
    UnpairedDataset,
    "examples",
    frozenset({UNPAIRED}),
    reads_rejected=False,
    sequences_per_item=2,
    builder="PaddedPairs",
)
"""Unpaired examples (KTO), laid out as pairs with their mismatched completions."""

ITEM_KINDS: dict[str, ItemKind] = {
    k.name: k for k in (PAIRS_KIND, REWARD_KIND, SFT_KIND, UNPAIRED_KIND)
}


def item_kind(kind: Any) -> ItemKind:
    """The :class:`ItemKind` named ``kind`` (a loss's ``item_kind``), or ``kind`` itself.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(kind, ItemKind):
        return kind
    if kind not in ITEM_KINDS:
        raise ValueError(f"unknown item kind {kind!r}; expected one of {sorted(ITEM_KINDS)}")
    return ITEM_KINDS[kind]
