"""KTO (Ethayarajh et al. 2024): a loss of unpaired examples, each a completion labelled desirable
or undesirable, against a KL reference point estimated over the whole step's batch.

The engine lays an unpaired example out as two sequences (`data.unpaired`,
`losses.targets.UnpairedTargets`): its completion (prompt + completion) and its KL completion (the
same prompt with another example's completion: the mismatched pair TRL and the paper use to
estimate KL(pi || pi_ref)). So

    policy_logps - reference_logps        = h(x, y)   the example's log-ratio,
    policy_kl_logps - reference_kl_logps  = h(x, y')  a mismatched log-ratio,

and the reference point z_0 = max(0, mean over the global batch of h(x, y')) (`KLReferencePoint`,
a step statistic: the same at any micro-batch size, data-parallel size or pipeline layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dpo_megatron.losses.registry import LossOutput, ParamRange, register_loss

Tensor = torch.Tensor


class KLReferencePoint:
    """KTO's z_0 for a training step: max(0, mean of the mismatched log-ratios h(x, y') of every
    example of the global batch), detached (Ethayarajh et al. 2024, Sec. 4.1; TRL's KTOTrainer takes
    the mean per device, then the mean over devices, clamped at 0: the same for equal shares).
    Evaluation steps use the last training step's z_0 (0 before the first).

    Its values read the KL completions only (``sides``: the second sequence of each example):
    the engine's statistic pass then computes those, and the loss's pass the examples' own
    (``BatchBuilder.computing``)."""

    sides = ("rejected",)
    """The sequences `item_values` reads (``data.batch.SIDES``: the KL completions)."""

    def __init__(self) -> None:
        self.kl = 0.0

    def item_values(
        self,
        policy_logps: Tensor,
        policy_kl_logps: Tensor,
        reference_logps: Tensor,
        reference_kl_logps: Tensor,
    ) -> Tensor:
        """[B] h(x, y') = log pi(y'|x) - log pi_ref(y'|x) of the KL completions (nats)."""
        return (policy_kl_logps - reference_kl_logps).detach()

    def begin_step(
        self, values: Tensor, keys: Tensor, training: bool
    ) -> tuple[dict[str, float], dict[str, Tensor]]:
        """({"kl": z_0}, {}) for the global batch's values; remembered for evaluation."""
        kl = max(0.0, values.double().mean().item())
        if training:
            self.kl = kl
        return {"kl": kl}, {}

    def loss_kwargs(self) -> dict[str, Any]:
        return {"kl": self.kl}

    def update(self, global_metrics: dict[str, float]) -> None:
        """Nothing: z_0 is set in `begin_step`."""

    def state_dict(self) -> dict[str, Any]:
        return {"kl": self.kl}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl = float(state["kl"])


@register_loss(
    "kto",
    needs_reference=True,
    unpaired=True,
    state_factory=KLReferencePoint,
    runtime_params=("kl",),
    uses_rejected=False,  # the KL completions reach the loss only through z_0
    ranges={
        "desirable_weight": ParamRange(0.0, low_open=True),
        "undesirable_weight": ParamRange(0.0, low_open=True),
    },
)
def kto_loss(
    policy_logps: Tensor,
    policy_kl_logps: Tensor,
    reference_logps: Tensor,
    reference_kl_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    desirable: Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl: float = 0.0,
) -> LossOutput:
    """KTO: with h = log pi(y|x) - log pi_ref(y|x) and the reference point z_0 = kl,
        desirable y:    lambda_D (1 - sigma(beta (h - z_0))),
        undesirable y:  lambda_U (1 - sigma(beta (z_0 - h)))
    (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv:2402.01306, Eq. 8; beta 0.1 and lambda_D = lambda_U = 1 as TRL's KTOConfig; the paper
    recommends lambda_D n_D / (lambda_U n_U) in [1, 4/3], see `weight_advice`).

    Args: as every loss, its first and second sequences being each example's completion and its KL
    completion (see the module docstring; the KL completions enter through z_0 only);
    desirable: [B] 1.0 for a desirable example, 0.0 for an undesirable one; kl: z_0 (the step
    statistic; 0 in a direct call); the token counts are unused.
    Metrics, per example, for the engine's means over the step (`finish_metrics` turns them into
    TRL's KTO names): rewards/chosen_sum, rewards/rejected_sum (beta h on one side, 0 on the other),
    logps/chosen_sum, logps/rejected_sum, count/chosen, count/rejected (the label), kl (z_0).
    Step-0 value (policy == reference, z_0 = 0): lambda/2 (1/2 with the default weights).
    """
    rewards = beta * (policy_logps - reference_logps)
    desirable = desirable.to(rewards.dtype)
    undesirable = 1.0 - desirable
    losses = desirable * desirable_weight * (
        1.0 - torch.sigmoid(rewards - beta * kl)
    ) + undesirable * undesirable_weight * (1.0 - torch.sigmoid(beta * kl - rewards))
    rewards, logps = rewards.detach(), policy_logps.detach()
    metrics = {
        "rewards/chosen_sum": rewards * desirable,
        "rewards/rejected_sum": rewards * undesirable,
        "logps/chosen_sum": logps * desirable,
        "logps/rejected_sum": logps * undesirable,
        "count/chosen": desirable,
        "count/rejected": undesirable,
        "kl": torch.full_like(rewards, kl),
    }
    return losses, metrics


def finish_kto_metrics(means: Mapping[str, float], count: int) -> dict[str, float]:
    """Per-example means of `kto_loss`'s metrics over `count` examples -> TRL's KTO metrics:
    rewards/chosen, rewards/rejected (mean beta h over the desirable / undesirable examples),
    rewards/margins (their difference), logps/chosen, logps/rejected, count/chosen, count/rejected
    (numbers of examples), kl; other keys pass through. A side without examples reports no
    rewards/logps for it (TRL: NaN)."""
    out = {k: v for k, v in means.items() if not k.endswith("_sum") and not k.startswith("count/")}
    for side in ("chosen", "rejected"):
        share = means[f"count/{side}"]
        out[f"count/{side}"] = share * count
        if share > 0:
            out[f"rewards/{side}"] = means[f"rewards/{side}_sum"] / share
            out[f"logps/{side}"] = means[f"logps/{side}_sum"] / share
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def one_label_advice(n_desirable: int, n_undesirable: int) -> str | None:
    """A warning when the training examples all carry one label (the paper's weight check has
    no ratio then): KTO's loss on the missing side is never taken and its rewards are never
    reported, as when a label column was written wrongly; None when both labels occur."""
    if n_desirable and n_undesirable:
        return None
    label, side = ("true", "desirable") if n_desirable else ("false", "undesirable")
    missing = "undesirable (label false)" if n_desirable else "desirable (label true)"
    return (
        f"KTO: all {n_desirable + n_undesirable} training examples are {side} (label {label}), "
        f"none {missing}: the loss of that side is never taken; check the data's label column"
    )


def weight_advice(
    n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """The paper's check (Ethayarajh et al. 2024, Sec. 4.2, as TRL's KTOTrainer warns): a warning
    when lambda_D n_D / (lambda_U n_U) is outside [1, 4/3], with the weights that would fit;
    None when it is inside or a side has no examples (then there is no ratio to fix)."""
    if not n_desirable or not n_undesirable:
        return None
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
    if 1.0 <= ratio <= 4.0 / 3.0:
        return None
    d_low = undesirable_weight * n_undesirable / n_desirable
    u_high = desirable_weight * n_desirable / n_undesirable
    return (
        f"KTO: loss.desirable_weight * {n_desirable} desirable / (loss.undesirable_weight * "
        f"{n_undesirable} undesirable) = {ratio:.3g} is outside the paper's [1, 4/3]; set EITHER "
        f"loss.desirable_weight in [{d_low:.3g}, {4 / 3 * d_low:.3g}] OR loss.undesirable_weight "
        "in "
        f"[{0.75 * u_high:.3g}, {u_high:.3g}] (not both)"
    )
