"""Test helper: call a registered pure loss on per-pair numbers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpo_megatron.losses import LOSSES

Numbers = float | Sequence[float]

INPUT_NAMES = (
    "policy_chosen_logps",
    "policy_rejected_logps",
    "reference_chosen_logps",
    "reference_rejected_logps",
    "chosen_tokens",
    "rejected_tokens",
)


def as_tensor(values: Numbers, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values if isinstance(values, (list, tuple)) else [values], dtype=dtype)


def call_loss(
    name: str,
    pc: Numbers,
    pr: Numbers,
    rc: Numbers,
    rr: Numbers,
    ct: Numbers,
    rt: Numbers,
    dtype: torch.dtype = torch.float64,
    **params,
):
    """LOSSES[name].fn on [B] tensors of `dtype` built from the given numbers; returns (losses,
    metrics)."""
    pc, pr, rc, rr, ct, rt = (as_tensor(v, dtype) for v in (pc, pr, rc, rr, ct, rt))
    return LOSSES[name].fn(pc, pr, rc, rr, chosen_tokens=ct, rejected_tokens=rt, **params)


def _layout(loss_mask: torch.Tensor) -> dict:
    return {"loss_mask": loss_mask, "score_index": torch.nonzero(loss_mask.reshape(-1)).squeeze(1)}


def pair_scores(policy, reference, loss_mask, log_sum_p2=None, statistic=None):
    """The loss's record of preference pairs' [2B, S] per-token log-probs (chosen rows, then
    rejected rows): ``LossFunction(pair_scores(...))``."""
    from dpo_megatron.losses.targets import PairTargets, SequenceScores

    return SequenceScores(
        PairTargets(**_layout(loss_mask)), policy, reference, log_sum_p2, statistic
    )


def sft_scores(policy, loss_mask):
    """The loss's record of SFT examples' [B, S] per-token log-probs."""
    from dpo_megatron.losses.targets import SequenceScores, SFTTargets

    return SequenceScores(SFTTargets(**_layout(loss_mask)), policy)


def unpaired_scores(policy, reference, loss_mask, desirable, statistic=None):
    """The loss's record of unpaired examples' [2B, S] per-token log-probs (each completion,
    then each KL completion) with their [B] labels."""
    from dpo_megatron.losses.targets import SequenceScores, UnpairedTargets

    return SequenceScores(
        UnpairedTargets(**_layout(loss_mask), desirable=desirable),
        policy,
        reference,
        statistic=statistic,
    )


def reward_scores(rewards, margin=None):
    """The loss's record of a reward model's [2B] rewards (chosen, then rejected)."""
    from dpo_megatron.losses.targets import RewardTargets, SequenceScores

    return SequenceScores(RewardTargets(torch.arange(rewards.shape[0]), margin), rewards)
