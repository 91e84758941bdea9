"""Formula pieces shared by several losses: Bradley-Terry term, NLL term, log(1 - exp(x)), metrics.

All functions are elementwise over per-pair tensors of shape [B]; log-probs are in nats.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def per_token_average(sequence_logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Length-normalised log-prob: sum over completion tokens / number of completion tokens.

    Args:
        sequence_logps: [B] summed log-probs (nats).
        tokens: [B] completion token counts (>= 1).
    Returns:
        [B] average log-prob per token (nats/token).
    """
    return sequence_logps / tokens


def bradley_terry_loss(logits: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the Bradley-Terry negative log-likelihood of
    "chosen beats rejected" for a margin z, with the labels flipped with probability eps
    (conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences"; eps = 0 gives
    Rafailov et al. 2023, Eq. 7).

    Args:
        logits: [B] the beta-scaled preference margin z.
        label_smoothing: eps in [0, 0.5).
    Returns:
        [B] loss (nats).
    """
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def chosen_nll(policy_chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of the chosen completion, -log pi(y_w|x) / |y_w|.

    This is the SFT / NLL term of RPO (Pang et al. 2024, Sec. 2), CPO (Xu et al. 2024, Eq. 4) and
    ORPO (Hong et al. 2024, L_SFT in Eq. 6). Averaged per pair, not over the pooled tokens of a
    batch.

    Returns:
        [B] nats per token.
    """
    return -per_token_average(policy_chosen_logps, chosen_tokens)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate and finite with finite gradients.

    Uses log(-expm1(x)) near 0 and log1p(-exp(x)) below -ln 2 (Maechler 2012, "Accurately Computing
    log(1 - exp(-|a|))"). Each branch only sees inputs from its own range, so the branch that is not
    selected cannot produce inf/NaN gradients. x is clamped to <= -eps of its dtype: an average
    log-prob closer to 0 than machine epsilon cannot be told from 0, where the value is -inf.
    """
    x = x.clamp(max=-torch.finfo(x.dtype).eps)
    near_zero = x > -math.log(2.0)
    minus_ln2 = torch.full_like(x, -math.log(2.0))
    near = torch.log(-torch.expm1(torch.where(near_zero, x, minus_ln2)))
    far = torch.log1p(-torch.exp(torch.where(near_zero, minus_ln2, x)))
    return torch.where(near_zero, near, far)


def preference_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The metrics every preference loss reports, per pair (TRL names), detached.

    Args:
        chosen_rewards, rejected_rewards: [B] the beta-scaled implicit rewards the loss compares
            (beta * log-ratio to the reference, or beta * policy log-prob for reference-free
            losses).
        policy_chosen_logps, policy_rejected_logps: [B] summed policy log-probs (nats).
    Returns:
        rewards/chosen, rewards/rejected, rewards/accuracies (1.0 where chosen > rejected strictly),
        rewards/margins, logps/chosen, logps/rejected; each [B].
    """
    return {
        **reward_metrics(chosen_rewards, rejected_rewards),
        "logps/chosen": policy_chosen_logps.detach(),
        "logps/rejected": policy_rejected_logps.detach(),
    }


def reward_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
) -> dict[str, torch.Tensor]:
    """rewards/chosen, rewards/rejected, rewards/accuracies (1.0 where chosen > rejected
    strictly: a tie counts as wrong) and rewards/margins (chosen - rejected), per pair, detached.

    Args:
        chosen_rewards, rejected_rewards: [B] the rewards compared (implicit or a reward model's).
    """
    chosen_rewards = chosen_rewards.detach()
    rejected_rewards = rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        "rewards/margins": chosen_rewards - rejected_rewards,
    }


def add_nll_term(
    losses: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    weight: float,
    policy_chosen_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
) -> torch.Tensor:
    """losses + weight * chosen_nll; records `nll_loss` in `metrics` (in place) when weight != 0.

    Returns:
        [B] the new losses.
    """
    if not weight:
        return losses
    nll = chosen_nll(policy_chosen_logps, chosen_tokens)
    metrics["nll_loss"] = nll.detach()
    return losses + weight * nll
