"""Per-token -> per-sequence reductions that feed the pure loss functions.

Rows follow the engine's layout: a micro-batch of B pairs is 2B rows, rows 0..B-1 the chosen and
rows B..2B-1 the rejected completions of the same pairs. Per-token tensors are [2B, S] with a
loss_mask [2B, S] that is 1 on completion-token label positions.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def split_pairs(rows: Tensor) -> tuple[Tensor, Tensor]:
    """[2B, ...] -> ([B, ...] chosen rows, [B, ...] rejected rows).

    Raises:
        ValueError: odd number of rows.
    """
    if rows.shape[0] % 2:
        raise ValueError(f"expected 2B rows (B chosen then B rejected), got {rows.shape[0]} rows")
    return rows.chunk(2, dim=0)


def sequence_logps(token_logps: Tensor, loss_mask: Tensor) -> Tensor:
    """Sum of log-probs over completion tokens: [N, S] -> [N] (nats)."""
    return (token_logps * loss_mask).sum(dim=-1)


def sequence_token_counts(loss_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Completion token counts [N, S] -> [N], at least 1 so that per-token averages of an empty
    completion are 0 instead of NaN (the data pipeline is expected to drop such rows)."""
    return loss_mask.sum(dim=-1).clamp(min=1).to(dtype)


def length_desensitized_logps(token_logps: Tensor, loss_mask: Tensor, ld_alpha: float) -> Tensor:
    """LD-DPO sequence log-probs (Liu et al. 2024, "Length Desensitization in Direct Preference
    Optimization", arXiv:2409.06411, Sec. 4): within each pair, the first l_p = min(|y_w|, |y_l|)
    completion tokens count with weight 1 and the rest with weight ld_alpha:
        log pi_hat(y|x) = sum_{t <= l_p} log p_t + ld_alpha * sum_{t > l_p} log p_t.
    Completion tokens are counted in mask order, so a prompt or padding before them does not shift
    l_p. Applied to policy and reference log-probs alike (TRL 1.x), so policy == reference still
    gives zero log-ratios.

    Args:
        token_logps: [2B, S] per-token log-probs.
        loss_mask: [2B, S] {0, 1}.
        ld_alpha: weight in [0, 1] of the tokens past the shared length (1 gives the plain sum).
    Returns:
        [2B] weighted sums (nats).
    """
    position = torch.cumsum(loss_mask, dim=-1)  # 1-based index of each completion token
    chosen_lengths, rejected_lengths = split_pairs(loss_mask.sum(dim=-1))
    public_lengths = torch.minimum(chosen_lengths, rejected_lengths).repeat(2)
    in_public = position <= public_lengths.unsqueeze(-1)
    weights = torch.where(
        in_public, torch.ones_like(token_logps), torch.full_like(token_logps, ld_alpha)
    )
    return sequence_logps(token_logps * weights, loss_mask)


def wpo_weights(
    policy_token_logps: Tensor, policy_token_log_sum_p2: Tensor, loss_mask: Tensor
) -> Tensor:
    """WPO pair weights (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference
    Optimization", arXiv:2406.11827, Eq. 2, with the sampling-probability normalisation of its
    Sec. 3 as implemented in TRL): per sequence
        w(y) = exp( mean_t [log p(y_t) - log sum_v p_v^2] ),
    pair weight min(1, w(y_w) * w(y_l)), detached (a weight, not a gradient path). The cap at 1 is
    that of the WPO authors' TRL implementation (TRL 0.x); TRL 1.x multiplies by the uncapped
    product.

    Args:
        policy_token_logps: [2B, S] policy log-probs of the labels.
        policy_token_log_sum_p2: [2B, S] log sum_v p_v^2 of the policy's next-token distribution.
        loss_mask: [2B, S] {0, 1}.
    Returns:
        [B] weights in (0, 1].
    """
    with torch.no_grad():
        adjusted = policy_token_logps - policy_token_log_sum_p2
        tokens = sequence_token_counts(loss_mask, adjusted.dtype)
        mean_adjusted = sequence_logps(adjusted, loss_mask) / tokens
        chosen, rejected = split_pairs(mean_adjusted)
        return torch.exp(chosen + rejected).clamp(max=1.0)
