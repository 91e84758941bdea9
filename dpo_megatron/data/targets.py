"""Each item kind's targets of one micro-batch (``losses.targets``), made from its items and the
per-sequence layout the batch builder laid out: one maker per kind in :data:`TARGET_MAKERS`, the
kind named by ``data.kinds.ItemKind.name``.

A maker takes the micro-batch's items (pairs, unpaired examples as pairs, or SFT examples) and
the layout of its N sequences: ``loss_mask`` [N, S], ``score_index`` [n], ``last_index`` [N] (the
model position of each sequence's last token that is not padding) and ``computed`` (False for a
sequence the micro-batch does not compute, ``BatchBuilder.computing``; None: every one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dpo_megatron.data.pairs import PreferencePair, UnpairedPair
from dpo_megatron.losses.targets import (
    PairTargets,
    RewardTargets,
    SFTTargets,
    Targets,
    UnpairedTargets,
)


def pair_margins(pairs: Sequence[PreferencePair]) -> torch.Tensor | None:
    """[B] fp32 margins of the pairs (``PreferencePair.margin``; 0 for a pair without one), or
    None when none has one."""
    margins = [getattr(p, "margin", None) for p in pairs]
    if all(m is None for m in margins):
        return None
    return torch.tensor([0.0 if m is None else m for m in margins], dtype=torch.float32)


def desirable_labels(examples: Sequence[UnpairedPair]) -> torch.Tensor:
    """[B] fp32 labels of unpaired examples (``UnpairedPair.desirable``: 1.0 / 0.0).

    Raises:
        ValueError: an item that is not an unpaired example (a preference pair).
    """
    if not all(isinstance(p, UnpairedPair) for p in examples):
        raise ValueError("a micro-batch of unpaired examples holds a preference pair")
    return torch.tensor([float(p.desirable) for p in examples], dtype=torch.float32)


def reference_logps(
    pairs: Sequence[PreferencePair],
    loss_mask: torch.Tensor,
    computed: Sequence[bool] | None = None,
) -> torch.Tensor | None:
    """[2B, S] precomputed reference log-probs at the scored positions (0 elsewhere), or None
    when the pairs carry none. ``computed`` [2B]: False for a sequence the micro-batch does not
    compute (``BatchBuilder.computing``), whose row stays 0; None: every sequence.

    Raises:
        ValueError: some pairs carry values and others do not, or a pair's values do not match
            its completion length (a stale table).
    """
    carried = [p.reference_chosen_logps is not None for p in pairs]
    if not any(carried):
        return None
    if not all(carried):
        raise ValueError(
            "a micro-batch mixes pairs with and without precomputed reference log-probs"
        )
    rows = [p.reference_chosen_logps for p in pairs] + [p.reference_rejected_logps for p in pairs]
    computed = [True] * len(rows) if computed is None else list(computed)
    counts = loss_mask.sum(-1).long().tolist()
    for k, (values, n) in enumerate(zip(rows, counts)):
        if computed[k] and values.numel() != n:
            raise ValueError(
                f"precomputed reference row {k} has {values.numel()} values for {n} "
                "completion tokens: the table is stale"
            )
    out = torch.zeros_like(loss_mask)
    laid = [values for values, keep in zip(rows, computed) if keep]
    if laid:
        out[loss_mask.bool()] = torch.cat(laid).to(out.dtype)
    return out


def pair_targets(items, loss_mask, score_index, last_index, computed=None) -> PairTargets:
    """Preference pairs: the layout, the margins and any precomputed reference log-probs."""
    return PairTargets(
        loss_mask,
        score_index,
        margin=pair_margins(items),
        reference_logps=reference_logps(items, loss_mask, computed),
    )


def unpaired_targets(items, loss_mask, score_index, last_index, computed=None) -> UnpairedTargets:
    """Unpaired examples (as ``UnpairedPair``: completion, KL completion): the layout, the
    labels and any precomputed reference log-probs."""
    return UnpairedTargets(
        loss_mask,
        score_index,
        desirable=desirable_labels(items),
        reference_logps=reference_logps(items, loss_mask, computed),
    )


def sft_targets(items, loss_mask, score_index, last_index, computed=None) -> SFTTargets:
    """SFT examples (or single sequences): the layout."""
    return SFTTargets(loss_mask, score_index)


def reward_targets(items, loss_mask, score_index, last_index, computed=None) -> RewardTargets:
    """A reward model's items: each sequence's last index, and pairs' margins; single sequences
    (SFT examples: one row per item) to score."""
    paired = loss_mask.shape[0] == 2 * len(items)
    return RewardTargets(
        last_index,
        margin=pair_margins(items) if paired else None,
        sequences_per_item=2 if paired else 1,
    )


TargetMaker = Callable[..., Targets]

TARGET_MAKERS: dict[str, TargetMaker] = {
    "pairs": pair_targets,
    "unpaired": unpaired_targets,
    "sft": sft_targets,
    "reward": reward_targets,
}
"""Item kind name (``data.kinds.ItemKind.name``) -> its targets' maker."""


def target_maker(kind: str) -> TargetMaker:
    """The maker of ``kind``'s targets.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in TARGET_MAKERS:
        raise ValueError(f"no targets for item kind {kind!r}; known: {sorted(TARGET_MAKERS)}")
    return TARGET_MAKERS[kind]
