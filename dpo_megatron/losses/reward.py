"""Reward-model training: the Bradley-Terry loss on a reward head's scalar scores.

The model's output is one reward per sequence (``LossSpec.model_head = "reward"``,
``models.reward_head``), so the function takes the chosen and rejected rewards where the
log-prob losses take the policy's log-probs; it reads no reference and no token counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpo_megatron.losses.registry import LossOutput, ParamRange, register_loss
from dpo_megatron.losses.terms import reward_metrics

Tensor = torch.Tensor


@register_loss(
    "bradley_terry",
    needs_reference=False,
    runtime_params=("margin",),
    model_head="reward",
    ranges={"center_rewards_coefficient": ParamRange(0.0)},
)
def bradley_terry_reward_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    chosen_tokens: Tensor | None,
    rejected_tokens: Tensor | None,
    margin: Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> LossOutput:
    """-log sigma(r_c - r_r - m) + c (r_c + r_r)^2 per pair.

    The Bradley-Terry model (Bradley & Terry 1952) of "chosen beats rejected" with the reward
    model's scores as log-strengths: Ouyang et al. 2022, eq. 1 (InstructGPT's reward model).
    ``margin`` m is a per-pair margin the data may carry (Llama 2's graded preferences, Touvron
    et al. 2023, eq. 2; TRL's ``margin`` column); c is TRL's ``center_rewards_coefficient``
    (Eisenstein et al. 2023): TRL adds c * mean((r_c + r_r)^2) to the batch loss, which is the
    mean over pairs of this per-pair term, and it pulls the rewards towards zero mean.

    Args:
        chosen_rewards, rejected_rewards: [B] rewards of the chosen and rejected sequences.
        reference_chosen_logps, reference_rejected_logps, chosen_tokens, rejected_tokens:
            unused (None); the registry's common signature.
        margin: [B] per-pair margins, or None (0).
        center_rewards_coefficient: c >= 0 (TRL's default None = 0).
    Returns:
        ([B] loss in nats, metrics ``rewards/chosen``, ``rewards/rejected`` (mean scores),
        ``rewards/accuracies``, ``rewards/margins``).
    """
    logits = chosen_rewards - rejected_rewards
    if margin is not None:
        logits = logits - margin
    losses = -F.logsigmoid(logits)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses, reward_metrics(chosen_rewards, rejected_rewards)
