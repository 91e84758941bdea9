"""Loss states that take a statistic of the whole step's batch (see `registry.StepStatistic`).

`BetaDPOStatistics`: beta-DPO's batch-level beta and its margin-based data filter (Wu et al. 2024).
"""

from __future__ import annotations

import math
from typing import Any

import torch

Tensor = torch.Tensor


class BetaDPOStatistics:
    """beta-DPO's step statistic (Wu et al. 2024, "beta-DPO: Direct Preference Optimization with
    Dynamic beta", arXiv:2407.08639, Sec. 4, and the authors' code github.com/junkangwu/beta-DPO).

    Per pair the statistic reads the log-ratio margin M_i = h_w - h_l (not beta-scaled, as the
    authors' code). Each training step, over the N pairs of the global batch:

    1. moving averages, updated *before* use (momentum m, both starting at 0):
           M_0 <- m M_0 + (1 - m) mean_i M_i,     sigma <- m sigma + (1 - m) std_i M_i  (unbiased);
    2. beta-guided data filtering: K = max(1, floor(N (1 - rho))) pairs are drawn without
       replacement with probability proportional to p(M_i) = exp(-(M_i - M_0)^2 / (2 sigma^2))
       (Gumbel top-K, which samples exactly that; uniforms drawn in dataset-index order from a
       generator seeded by the step count, so the draw does not depend on the layout);
    3. the batch-level beta  beta_batch = max(1e-3, beta_0 [1 + alpha (mean_{i kept} M_i - M_0)])
       (Eq. 8 of the paper with the authors' floor).

    The loss then averages -log sigma(beta_batch h_i) over the kept pairs: each pair gets the weight
    N / K if kept, else 0 (the engine divides the per-pair sum by N). Differences from the authors'
    code: the statistics and the draw cover the whole optimizer step (their code takes them per
    gradient-accumulation micro-batch, gathered over data-parallel ranks only); sigma is floored at
    1e-12 (their code divides 0 by 0 at step 0, where every margin is 0, and gets NaN weights).
    Evaluation steps use beta_0 and every pair, and leave the averages unchanged.

    Args (config keys under `loss.`):
        beta: beta_0 (the paper's runs use 0.1).
        beta_dpo_alpha: alpha, the scaling of beta by the margin (0.6 in the authors' example).
        beta_dpo_filter_ratio: rho, the fraction of each batch filtered out (0.2 as the authors).
        beta_dpo_momentum: m of the moving averages (0.9 as the authors' code).
    """

    min_beta = 1e-3
    """The authors' floor on beta_batch."""

    def __init__(
        self,
        *,
        beta: float = 0.1,
        beta_dpo_alpha: float = 0.6,
        beta_dpo_filter_ratio: float = 0.2,
        beta_dpo_momentum: float = 0.9,
    ) -> None:
        self.beta = beta
        self.alpha = beta_dpo_alpha
        self.filter_ratio = beta_dpo_filter_ratio
        self.momentum = beta_dpo_momentum
        self.margin_mean = 0.0
        self.margin_std = 0.0
        self.steps = 0

    def item_values(
        self,
        policy_chosen_logps: Tensor,
        policy_rejected_logps: Tensor,
        reference_chosen_logps: Tensor,
        reference_rejected_logps: Tensor,
    ) -> Tensor:
        """[B] the log-ratio margins M_i = h_w - h_l (detached, nats)."""
        return (
            (policy_chosen_logps - reference_chosen_logps)
            - (policy_rejected_logps - reference_rejected_logps)
        ).detach()

    def kept_count(self, n: int) -> int:
        """K: pairs kept of a batch of n (at least one)."""
        return max(1, math.floor(n * (1.0 - self.filter_ratio) + 1e-9))

    def begin_step(
        self, values: Tensor, keys: Tensor, training: bool
    ) -> tuple[dict[str, float], dict[str, Tensor]]:
        """One training step's beta_batch and per-pair weights (see the class docstring).

        Args:
            values: [N] margins M_i of the global batch (any order).
            keys: [N] dataset indices of the same pairs (the order uniforms are drawn in).
            training: on False returns ({}, {}) (the loss then uses beta_0 and every pair).
        Returns:
            ({"batch_beta": beta_batch}, {"pair_weights": [N] float64, N/K kept, 0 filtered}).
        """
        if not training:
            return {}, {}
        values = values.double().cpu()
        n = values.numel()
        batch_std = values.std().item() if n > 1 else 0.0
        m = self.momentum
        self.margin_mean = m * self.margin_mean + (1.0 - m) * values.mean().item()
        self.margin_std = m * self.margin_std + (1.0 - m) * batch_std
        log_weights = -0.5 * ((values - self.margin_mean) / max(self.margin_std, 1e-12)) ** 2
        kept = self._draw(log_weights, keys, self.kept_count(n))
        self.steps += 1
        weights = torch.zeros(n, dtype=torch.float64)
        weights[kept] = n / kept.numel()
        batch_beta = self.beta * (
            1.0 + self.alpha * (values[kept].mean().item() - self.margin_mean)
        )
        return {"batch_beta": max(self.min_beta, batch_beta)}, {"pair_weights": weights}

    def _draw(self, log_weights: Tensor, keys: Tensor, k: int) -> Tensor:
        """Indices of k pairs drawn without replacement with probabilities proportional to
        exp(log_weights): the k largest log w_i + Gumbel_i (Gumbel top-k). The uniforms are drawn in
        the order of `keys`, from a generator seeded by the step count."""
        order = torch.argsort(keys.cpu(), stable=True)
        generator = torch.Generator().manual_seed(1_000_003 * (self.steps + 1))
        uniforms = torch.empty(keys.numel(), dtype=torch.float64)
        uniforms[order] = torch.rand(keys.numel(), generator=generator, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(uniforms.clamp(min=1e-300)))
        return torch.topk(log_weights + gumbel, k).indices

    def loss_kwargs(self) -> dict[str, Any]:
        return {}

    def update(self, global_metrics: dict[str, float]) -> None:
        """Nothing: the averages move in `begin_step`, before the step uses them."""

    def state_dict(self) -> dict[str, Any]:
        return {"margin_mean": self.margin_mean, "margin_std": self.margin_std, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.margin_mean = float(state["margin_mean"])
        self.margin_std = float(state["margin_std"])
        self.steps = int(state["steps"])
