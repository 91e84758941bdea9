"""Reference-free preference losses (SimPO, CPO, ORPO) and the SFT loss.

Same signature as `dpo_family`; the reference log-probs are accepted and ignored (the caller
passes None: no reference model is built or run). rewards/* are beta times the policy log-probs the
loss compares (per-token averages for SimPO and ORPO, sums for CPO).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpo_megatron.losses.registry import LossOutput, ParamRange, register_loss
from dpo_megatron.losses.terms import (
    add_nll_term,
    bradley_terry_loss,
    chosen_nll,
    log1mexp,
    per_token_average,
    preference_metrics,
)

Tensor = torch.Tensor


@register_loss("simpo", needs_reference=False, ranges={"cpo_alpha": ParamRange(0.0)})
def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 2.0,
    simpo_gamma: float = 1.0,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    average_logps: bool = True,
) -> LossOutput:
    """SimPO: -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)
    (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    arXiv:2405.14734, Eq. 6). simpo_gamma is the target margin gamma itself (not gamma/beta);
    defaults beta = 2.0, gamma = 1.0 (gamma/beta = 0.5, the paper's recommended setting).
    label_smoothing as in cDPO; cpo_alpha > 0 adds cpo_alpha * per-token NLL of the chosen
    completion (CPO-SimPO). average_logps=False uses summed log-probs instead.
    """
    if average_logps:
        chosen = per_token_average(policy_chosen_logps, chosen_tokens)
        rejected = per_token_average(policy_rejected_logps, rejected_tokens)
    else:
        chosen, rejected = policy_chosen_logps, policy_rejected_logps
    losses = bradley_terry_loss(beta * (chosen - rejected) - simpo_gamma, label_smoothing)
    metrics = preference_metrics(
        beta * chosen, beta * rejected, policy_chosen_logps, policy_rejected_logps
    )
    return add_nll_term(losses, metrics, cpo_alpha, policy_chosen_logps, chosen_tokens), metrics


@register_loss("cpo", needs_reference=False, ranges={"cpo_alpha": ParamRange(0.0)})
def cpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
) -> LossOutput:
    """CPO: -log sigma(beta log pi(y_w|x) - beta log pi(y_l|x)) + cpo_alpha * NLL(y_w)
    (Xu et al. 2024, "Contrastive Preference Optimization", arXiv:2401.08417, L_CPO = L_prefer +
    L_NLL, Sec. 3; summed log-probs in L_prefer, per-token NLL, beta 0.1 and alpha 1 as in the
    paper). For CPO-SimPO use `simpo` with cpo_alpha > 0.
    """
    losses = bradley_terry_loss(
        beta * (policy_chosen_logps - policy_rejected_logps), label_smoothing
    )
    metrics = preference_metrics(
        beta * policy_chosen_logps,
        beta * policy_rejected_logps,
        policy_chosen_logps,
        policy_rejected_logps,
    )
    return add_nll_term(losses, metrics, cpo_alpha, policy_chosen_logps, chosen_tokens), metrics


@register_loss("orpo", needs_reference=False)
def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    average_logps: bool = True,
) -> LossOutput:
    """ORPO: NLL(y_w) - lambda * log sigma(log odds(y_w) - log odds(y_l)), odds(y) = p / (1 - p),
    p = exp(mean per-token log pi(y|x))  (Hong et al. 2024, "ORPO: Monolithic Preference
    Optimization without Reference Model", arXiv:2403.07691, Eq. 6 (L_ORPO = L_SFT + lambda L_OR)
    and Eq. 7 (L_OR)).

    lambda is `beta` (default 0.1, as in the paper). log(1 - p) = log1mexp(log p) is computed in at
    least float32 with the stable two-branch form, so bf16 inputs and average log-probs at 0 or
    -1e-8 stay finite. Metrics add nll_loss, log_odds_ratio (log sigma of the log-odds difference,
    TRL's name) and log_odds_chosen (the log-odds difference).
    """
    compute_dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    chosen_sum = policy_chosen_logps.to(compute_dtype)
    rejected_sum = policy_rejected_logps.to(compute_dtype)
    if average_logps:
        chosen = per_token_average(chosen_sum, chosen_tokens.to(compute_dtype))
        rejected = per_token_average(rejected_sum, rejected_tokens.to(compute_dtype))
    else:
        chosen, rejected = chosen_sum, rejected_sum
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    log_odds_ratio = F.logsigmoid(log_odds)
    metrics = preference_metrics(beta * chosen, beta * rejected, chosen_sum, rejected_sum)
    metrics["log_odds_ratio"] = log_odds_ratio.detach()
    metrics["log_odds_chosen"] = log_odds.detach()
    return add_nll_term(
        -beta * log_odds_ratio, metrics, 1.0, chosen_sum, chosen_tokens.to(compute_dtype)
    ), metrics


@register_loss("sft", needs_reference=False, uses_rejected=False)
def sft_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor | None,
    reference_chosen_logps: Tensor | None,
    reference_rejected_logps: Tensor | None,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor | None,
) -> LossOutput:
    """SFT: per-token negative log-likelihood of the chosen completion, -log pi(y_w|x) / |y_w|.
    Uses neither the rejected completion nor a reference model. Metrics: nll_loss, logps/chosen.
    """
    nll = chosen_nll(policy_chosen_logps, chosen_tokens)
    return nll, {"nll_loss": nll.detach(), "logps/chosen": policy_chosen_logps.detach()}
