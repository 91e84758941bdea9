"""Reference-based preference losses (DPO and its variants), as pure functions of per-sequence
log-probs.

Every function takes
    policy_chosen_logps, policy_rejected_logps: [B] summed policy log-probs of the completions
    (nats)
    reference_chosen_logps, reference_rejected_logps: [B] the same under the reference model
    chosen_tokens, rejected_tokens: [B] completion token counts (used by length-averaged losses)
and returns (losses [B], metrics dict of [B] tensors). Notation: the log-ratios are
    h_w = log pi(y_w|x) - log pi_ref(y_w|x),   h_l = log pi(y_l|x) - log pi_ref(y_l|x),
the DPO margin is h = h_w - h_l, and rewards/chosen = beta * h_w, rewards/rejected = beta * h_l.
With `reference_free: true` the caller passes zeros for the reference log-probs.
Defaults follow the papers where they state one, else TRL's DPOConfig (beta 0.1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpo_megatron.losses.registry import LossOutput, ParamRange, register_loss
from dpo_megatron.losses.running_mean import RunningRewardMean
from dpo_megatron.losses.step_statistics import BetaDPOStatistics
from dpo_megatron.losses.terms import (
    add_nll_term,
    bradley_terry_loss,
    per_token_average,
    preference_metrics,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class LogRatios:
    """Per-pair log-ratios to the reference and the summed policy log-probs they came from."""

    chosen: Tensor
    """[B] h_w = log pi(y_w|x) - log pi_ref(y_w|x) (nats, or nats/token after `per_token`)."""
    rejected: Tensor
    """[B] h_l, the same for the rejected completion."""
    policy_chosen_logps: Tensor
    """[B] summed policy log-probs of y_w (reported as logps/chosen)."""
    policy_rejected_logps: Tensor
    """[B] summed policy log-probs of y_l (reported as logps/rejected)."""

    @classmethod
    def of(
        cls,
        policy_chosen_logps: Tensor,
        policy_rejected_logps: Tensor,
        reference_chosen_logps: Tensor,
        reference_rejected_logps: Tensor,
    ) -> LogRatios:
        return cls(
            policy_chosen_logps - reference_chosen_logps,
            policy_rejected_logps - reference_rejected_logps,
            policy_chosen_logps,
            policy_rejected_logps,
        )

    @property
    def margin(self) -> Tensor:
        """[B] the DPO margin h = h_w - h_l."""
        return self.chosen - self.rejected

    def per_token(self, chosen_tokens: Tensor, rejected_tokens: Tensor) -> LogRatios:
        """Log-ratios divided by the completion token counts (IPO's length-averaged form)."""
        return dataclasses.replace(
            self,
            chosen=per_token_average(self.chosen, chosen_tokens),
            rejected=per_token_average(self.rejected, rejected_tokens),
        )

    def metrics(self, beta: float) -> dict[str, Tensor]:
        """Preference metrics with rewards beta * h_w and beta * h_l."""
        return preference_metrics(
            beta * self.chosen,
            beta * self.rejected,
            self.policy_chosen_logps,
            self.policy_rejected_logps,
        )


@register_loss("sigmoid", needs_reference=True)
def sigmoid_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """DPO: -log sigma(beta * h)  (Rafailov et al. 2023, arXiv:2305.18290, Eq. 7).

    label_smoothing eps > 0 gives conservative DPO (cDPO, Mitchell 2023, "A note on DPO with noisy
    preferences and relationship to IPO"): -(1 - eps) log sigma(beta h) - eps log sigma(-beta h).
    Step-0 value (policy == reference): ln 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = bradley_terry_loss(beta * ratios.margin, label_smoothing)
    return losses, ratios.metrics(beta)


@register_loss("rpo", needs_reference=True, ranges={"rpo_alpha": ParamRange(0.0)})
def rpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    rpo_alpha: float = 1.0,
) -> LossOutput:
    """RPO: DPO + rpo_alpha * per-token NLL of the chosen completion,
    -log sigma(beta h) - alpha * log pi(y_w|x) / |y_w|  (Pang et al. 2024, "Iterative Reasoning
    Preference Optimization", arXiv:2404.19733, L_DPO+NLL, Sec. 2; alpha = 1 in the paper).
    Metrics add `nll_loss`.
    """
    losses, metrics = sigmoid_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    return add_nll_term(losses, metrics, rpo_alpha, policy_chosen_logps, chosen_tokens), metrics


@register_loss("robust", needs_reference=True)
def robust_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """Robust DPO (rDPO): an unbiased estimate of the DPO loss under preference flips with rate eps,
    [-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)
    (Chowdhury et al. 2024, "Provably Robust DPO", arXiv:2403.00409, the rDPO loss of Sec. 3).
    eps = label_smoothing must be < 0.5. Step-0 value: ln 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    logits = beta * ratios.margin
    losses = (
        -(1.0 - label_smoothing) * F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)
    ) / (1.0 - 2.0 * label_smoothing)
    return losses, ratios.metrics(beta)


@register_loss(
    "exo_pair",
    needs_reference=True,
    ranges={"label_smoothing": ParamRange(0.0, 1.0, low_open=True, high_open=True)},
)
def exo_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 1e-3,
) -> LossOutput:
    """EXO (pairwise): reverse KL from the model's preference distribution to smoothed labels,
    sigma(z) [log sigma(z) - log(1 - eps)] + sigma(-z) [log sigma(-z) - log eps],  z = beta h
    (Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment",
    arXiv:2402.00856, Eq. 16). eps in (0, 1); 1e-3 as in the paper's pairwise setting and TRL.
    Step-0 value: -ln 2 - (ln eps + ln(1 - eps)) / 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    logits = beta * ratios.margin
    log_eps = torch.log(torch.tensor(label_smoothing, dtype=logits.dtype))
    log_one_minus_eps = torch.log1p(torch.tensor(-label_smoothing, dtype=logits.dtype))
    losses = torch.sigmoid(logits) * (F.logsigmoid(logits) - log_one_minus_eps) + torch.sigmoid(
        -logits
    ) * (F.logsigmoid(-logits) - log_eps)
    return losses, ratios.metrics(beta)


@register_loss("hinge", needs_reference=True)
def hinge_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
) -> LossOutput:
    """SLiC hinge on the reference-normalised likelihood: max(0, 1 - beta h), i.e. margin delta =
    1/beta (Zhao et al. 2023, "SLiC-HF", arXiv:2305.10425, Eq. 1 calibration loss;
    reference-normalised form "hinge-norm" of Liu et al. 2023, "Statistical Rejection Sampling",
    arXiv:2309.06657, Sec. 3). Step-0 value: 1.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = torch.relu(1.0 - beta * ratios.margin)
    return losses, ratios.metrics(beta)


@register_loss("ipo", needs_reference=True)
def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    average_logps: bool = True,
) -> LossOutput:
    """IPO: (h - 1 / (2 tau))^2 with tau = beta (Azar et al. 2023, "A General Theoretical Paradigm
    to Understand Learning from Human Preferences", arXiv:2310.12036, Eq. 17).

    With average_logps (default, as TRL) every log-prob is first divided by its completion's token
    count; rewards/* then are beta times the per-token log-ratios. Step-0 value: 1 / (4 beta^2).
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    if average_logps:
        ratios = ratios.per_token(chosen_tokens, rejected_tokens)
    losses = (ratios.margin - 1.0 / (2.0 * beta)) ** 2
    return losses, ratios.metrics(beta)


@register_loss("sigmoid_norm", needs_reference=True)
def sigmoid_norm_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
) -> LossOutput:
    """Length-normalised DPO: -log sigma(beta (h_w / |y_w| - h_l / |y_l|)), each log-ratio divided
    by its completion's token count (Lambert et al. 2024, "Tulu 3", arXiv:2411.15124, the
    length-normalised DPO it trains with; TRL's ``sigmoid_norm``). rewards/* are beta times the
    per-token log-ratios, as ``ipo``'s. Step-0 value: ln 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    ).per_token(chosen_tokens, rejected_tokens)
    return bradley_terry_loss(beta * ratios.margin), ratios.metrics(beta)


@register_loss("nca_pair", needs_reference=True)
def nca_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
) -> LossOutput:
    """NCA (pairwise): -log sigma(beta h_w) - 1/2 log sigma(-beta h_w) - 1/2 log sigma(-beta h_l)
    (Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards",
    arXiv:2402.05369, NCA loss with K = 2 responses). Step-0 value: 2 ln 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    chosen_rewards = beta * ratios.chosen
    rejected_rewards = beta * ratios.rejected
    losses = (
        -F.logsigmoid(chosen_rewards)
        - 0.5 * F.logsigmoid(-chosen_rewards)
        - 0.5 * F.logsigmoid(-rejected_rewards)
    )
    return losses, ratios.metrics(beta)


@register_loss(
    "bco_pair",
    needs_reference=True,
    state_factory=RunningRewardMean,
    runtime_params=("reward_mean",),
)
def bco_pair_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    reward_mean: float = 0.0,
) -> LossOutput:
    """BCO (pairwise): binary classification of chosen vs rejected with a reward shift delta,
    -log sigma(beta h_w - delta) - log sigma(-(beta h_l - delta))
    (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment",
    arXiv:2404.04656, BCO loss with reward shift, Sec. 3).

    delta = reward_mean is the running mean of the rewards beta*h over all chosen and rejected
    completions of past optimizer steps (kept by `RunningRewardMean`, 0 before the first step);
    TRL 0.x instead folds in the current batch before using it (so its step-0 delta is that batch's
    mean; with policy == reference both are 0); TRL 1.x dropped the shift (delta = 0 always).
    Metrics add `bco/reward_mean` (per pair (beta h_w + beta h_l) / 2, whose global mean updates
    delta) and `bco/delta`. Step-0 value with delta = 0: 2 ln 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    chosen_rewards = beta * ratios.chosen
    rejected_rewards = beta * ratios.rejected
    losses = -F.logsigmoid(chosen_rewards - reward_mean) - F.logsigmoid(
        -(rejected_rewards - reward_mean)
    )
    metrics = ratios.metrics(beta)
    metrics["bco/reward_mean"] = (0.5 * (chosen_rewards + rejected_rewards)).detach()
    metrics["bco/delta"] = torch.full_like(losses, reward_mean).detach()
    return losses, metrics


@register_loss("sppo_hard", needs_reference=True)
def sppo_hard_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
) -> LossOutput:
    """SPPO with hard win probabilities: (h_w - 1/(2 beta))^2 + (h_l + 1/(2 beta))^2
    (Wu et al. 2024, "Self-Play Preference Optimization", arXiv:2405.00675, Eq. 4.7 of Algorithm 1
    with P = 1 for the winner and 0 for the loser, eta = 1/beta). Step-0 value: 1 / (2 beta^2).
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = (ratios.chosen - 0.5 / beta) ** 2 + (ratios.rejected + 0.5 / beta) ** 2
    return losses, ratios.metrics(beta)


@register_loss("aot", needs_reference=True, sorts_batch=True)
def aot_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """AOT (paired): first-order stochastic dominance via optimal transport in one dimension, i.e.
    the DPO loss on sorted quantiles: BT(beta * (sort(log pi_w/pi_l) - sort(log ref_w/ref_l)))
    (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport",
    arXiv:2406.05882, AOT paired objective). The sort runs over the B pairs of this call (a
    micro-batch), so entry i of `losses` belongs to the i-th quantile, not to pair i; the mean over
    pairs is what the loss defines. Step-0 value: ln 2.
    """
    sorted_policy = torch.sort(policy_chosen_logps - policy_rejected_logps, dim=0).values
    sorted_reference = torch.sort(reference_chosen_logps - reference_rejected_logps, dim=0).values
    losses = bradley_terry_loss(beta * (sorted_policy - sorted_reference), label_smoothing)
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    return losses, ratios.metrics(beta)


@register_loss("aot_unpaired", needs_reference=True, sorts_batch=True)
def aot_unpaired_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """AOT (unpaired; TRL 1.x's `aot_unpaired`, 0.x's `aot_pair`): the chosen log-ratio
    distribution should dominate the rejected one, BT(beta * (sort(h_w) - sort(h_l))) (Melnyk et
    al. 2024, arXiv:2406.05882, AOT unpaired objective). Sorting is over the B pairs of the
    call, as for `aot`. Step-0 value: ln 2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    delta = torch.sort(ratios.chosen, dim=0).values - torch.sort(ratios.rejected, dim=0).values
    losses = bradley_terry_loss(beta * delta, label_smoothing)
    return losses, ratios.metrics(beta)


@register_loss("apo_zero", needs_reference=True)
def apo_zero_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
) -> LossOutput:
    """APO-zero: (1 - sigma(beta h_w)) + sigma(beta h_l): raise the chosen, lower the rejected
    likelihood (D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive
    Revisions", arXiv:2408.06266, Eq. 7). Step-0 value: 1.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = 1.0 - torch.sigmoid(beta * ratios.chosen) + torch.sigmoid(beta * ratios.rejected)
    return losses, ratios.metrics(beta)


@register_loss("apo_down", needs_reference=True)
def apo_down_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
) -> LossOutput:
    """APO-down: sigma(beta h_w) + (1 - sigma(beta (h_w - h_l))): lower both likelihoods, the
    rejected more (D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 8). Step-0 value: 1.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = torch.sigmoid(beta * ratios.chosen) + 1.0 - torch.sigmoid(beta * ratios.margin)
    return losses, ratios.metrics(beta)


@register_loss(
    "discopop", needs_reference=True, ranges={"discopop_tau": ParamRange(0.0, low_open=True)}
)
def discopop_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    discopop_tau: float = 0.05,
) -> LossOutput:
    """DiscoPOP (log-ratio modulated loss): with z = beta h and m = sigma(z / tau),
    (1 - m) * (-log sigma(z)) + m * exp(-z)
    (Chris Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for Large
    Language Models", arXiv:2406.08414, Eq. 5; tau = 0.05 in the paper). Step-0 value: (ln 2 + 1) /
    2.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    logits = beta * ratios.margin
    modulation = torch.sigmoid(logits / discopop_tau)
    losses = (1.0 - modulation) * -F.logsigmoid(logits) + modulation * torch.exp(-logits)
    return losses, ratios.metrics(beta)


@register_loss(
    "beta_dpo",
    needs_reference=True,
    state_factory=BetaDPOStatistics,
    runtime_params=("batch_beta", "pair_weights"),
    ranges={
        "beta_dpo_alpha": ParamRange(0.0),
        "beta_dpo_filter_ratio": ParamRange(0.0, 1.0, high_open=True),
        "beta_dpo_momentum": ParamRange(0.0, 1.0, high_open=True),
    },
)
def beta_dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 0.1,
    batch_beta: float | None = None,
    pair_weights: Tensor | None = None,
) -> LossOutput:
    """beta-DPO: w_i * -log sigma(beta_batch h_i) (Wu et al. 2024, "beta-DPO: Direct Preference
    Optimization with Dynamic beta", arXiv:2407.08639, Eq. 8 with the beta-guided filter of Sec.
    4.2).

    beta_batch = beta_0 [1 + alpha (mean_{kept} M_i - M_0)] and the weights w_i (N/K for the K kept
    pairs of the global batch, 0 for the filtered ones) come from the step statistic
    (`step_statistics.BetaDPOStatistics`, whose keys beta_dpo_alpha = 0.6, beta_dpo_filter_ratio =
    0.2, beta_dpo_momentum = 0.9 are config keys of this loss); unset (evaluation, or a direct call)
    they are beta_0 and 1. rewards/* use beta_0 (as the authors' code). Metrics add `beta_dpo/beta`
    (beta_batch) and `beta_dpo/kept` (1 for a kept pair). Step-0 value (policy == reference): ln 2,
    the mean over the kept pairs.
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    step_beta = beta if batch_beta is None else batch_beta
    losses = -F.logsigmoid(step_beta * ratios.margin)
    weights = torch.ones_like(losses) if pair_weights is None else pair_weights.to(losses)
    metrics = ratios.metrics(beta)
    metrics["beta_dpo/beta"] = torch.full_like(losses, step_beta).detach()
    metrics["beta_dpo/kept"] = (weights > 0).to(losses.dtype)
    return losses * weights, metrics


@register_loss("cal_dpo", needs_reference=True)
def cal_dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    beta: float = 1e-3,
) -> LossOutput:
    """Cal-DPO: a DPO term on the unscaled log-ratios plus a calibration term pulling them to the
    fixed targets +-1/(2 beta):
        -log sigma(h_w - h_l) + 1/2 [(h_w - 1/(2 beta))^2 + (h_l + 1/(2 beta))^2]
    (Xiao et al. 2024, "Cal-DPO: Calibrated Direct Preference Optimization for Language Model
    Alignment", arXiv:2412.14516, Eq. 10, with the 1/2 on the calibration term of the authors' code,
    github.com/tengxiao1/Cal-DPO, `loss_type="Cal-DPO"`; beta = 1e-3 as their run script).
    The calibration term is per pair, so no batch statistic is involved. rewards/* are beta * h as
    for DPO; metrics add `cal_dpo/calibration` (the calibration term). Step-0 value:
    ln 2 + 1 / (4 beta^2).
    """
    ratios = LogRatios.of(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    target = 0.5 / beta
    calibration = 0.5 * ((ratios.chosen - target) ** 2 + (ratios.rejected + target) ** 2)
    losses = -F.logsigmoid(ratios.margin) + calibration
    metrics = ratios.metrics(beta)
    metrics["cal_dpo/calibration"] = calibration.detach()
    return losses, metrics
