"""Per-token log-probabilities from vocab-parallel logits, reduced across TP ranks.

Each tensor-parallel rank holds logits for a contiguous slice of the vocabulary. The
log-softmax needs the max and the sum of exponentials over the *whole* vocabulary, and the
target token's logit lives on exactly one rank, so three all-reduces over the TP group (max, sum,
sum) give exact log-probs without ever gathering the vocabulary:

    log p(y_t) = z_t[y_t] - (m_t + log sum_v exp(z_t[v] - m_t)),   m_t = max_v z_t[v]

(the standard log-sum-exp identity; the same decomposition as megatron-core's
``vocab_parallel_cross_entropy``). Everything is computed in fp32 for bf16/fp16/fp32 logits (fp64 stays fp64).

Memory: the fp32 copy of the logits is made one chunk of rows at a time, and backward recomputes
the softmax from the saved (model-dtype) logits and the saved per-token log-sum-exp, so no
fp32 [tokens, vocab/TP] tensor outlives a chunk.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 1024
"""Rows (tokens) of logits converted to fp32 at a time."""


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 logits; fp64 stays fp64 (for gradcheck)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _target_in_shard(labels: torch.Tensor, vocab_start: int, shard_size: int):
    """(local index clamped into the shard, bool mask of targets owned by this rank)."""
    owned = (labels >= vocab_start) & (labels < vocab_start + shard_size)
    local = (labels - vocab_start).clamp(0, shard_size - 1)
    return local, owned


class _VocabParallelTokenLogps(torch.autograd.Function):
    """logits [N, V/TP], labels [N] -> log p(label) [N] fp32 (see module docstring)."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, chunk_tokens):
        n, shard = logits.shape
        dtype = _compute_dtype(logits)
        logps = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        local, owned = _target_in_shard(labels, vocab_start, shard)
        for s in range(0, n, chunk_tokens):
            z = logits[s:s + chunk_tokens].to(dtype)
            m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
            sum_exp = _all_reduce((z - m[:, None]).exp().sum(dim=-1), dist.ReduceOp.SUM, group)
            lse[s:s + chunk_tokens] = m + sum_exp.log()
            target = z.gather(-1, local[s:s + chunk_tokens, None]).squeeze(-1)
            # where, not multiply: an unowned target's clamped index may be a -inf padding column.
            target = torch.where(owned[s:s + chunk_tokens], target, 0.0)
            target = _all_reduce(target, dist.ReduceOp.SUM, group)
            logps[s:s + chunk_tokens] = target - lse[s:s + chunk_tokens]
        ctx.save_for_backward(logits, local, owned, lse)
        ctx.chunk_tokens = chunk_tokens
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        # d log p(y) / d z_v = 1[v == y] - softmax(z)_v; each rank fills its vocabulary slice.
        logits, local, owned, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        grad_logps = grad_logps.to(lse.dtype)
        step = ctx.chunk_tokens
        for s in range(0, logits.shape[0], step):
            g = grad_logps[s:s + step, None]
            chunk = -(logits[s:s + step].to(lse.dtype) - lse[s:s + step, None]).exp() * g
            chunk.scatter_add_(-1, local[s:s + step, None], g * owned[s:s + step, None])
            grad_logits[s:s + step] = chunk.to(logits.dtype)
        return grad_logits, None, None, None, None


def _tp_context(group) -> tuple[Optional[object], int]:
    from megatron.core import parallel_state

    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group) if group is not None else 0
    return group, rank


def vocab_parallel_token_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """log p(labels[..., t] | context) for every position, from this rank's vocabulary shard.

    Args:
        logits: [..., V/TP] logits for this TP rank's contiguous vocabulary slice (any float
            dtype; the slice of rank r starts at r * V/TP, megatron-core's layout).
        labels: [...] int64 target token ids in the full vocabulary (already shifted: the
            target of position t is token t+1).
        group: TP process group (default: megatron-core's tensor-model-parallel group).
        chunk_tokens: rows converted to fp32 at a time (bounds peak memory).

    Returns:
        [...] log-probabilities in nats, fp32 (fp64 for fp64 logits). Differentiable w.r.t.
        ``logits``. Columns with -inf logits (vocabulary padding) get probability 0.
    """
    group, rank = _tp_context(group)
    shard = logits.shape[-1]
    flat = _VocabParallelTokenLogps.apply(
        logits.reshape(-1, shard), labels.reshape(-1), group, rank * shard, chunk_tokens)
    return flat.view(labels.shape)


@torch.no_grad()
def vocab_parallel_log_sum_p2(
    logits: torch.Tensor, group=None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """log sum_v p_v^2 per position, the normaliser of the WPO weights (Zhou et al.
    2024, arXiv:2406.11827, Sec. 3; used by ``dpo_megatron.losses.sequence.wpo_weights``).

    log sum_v p_v^2 = logsumexp_v(2 z_v) - 2 logsumexp_v(z_v), both sums all-reduced over TP.
    Shapes: logits [..., V/TP] -> [...] fp32. No gradient (WPO weights are constants).
    """
    group, _ = _tp_context(group)
    flat = logits.reshape(-1, logits.shape[-1])
    dtype = _compute_dtype(logits)
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for s in range(0, flat.shape[0], chunk_tokens):
        z = flat[s:s + chunk_tokens].to(dtype)
        m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        sum1 = _all_reduce((z - m[:, None]).exp().sum(-1), dist.ReduceOp.SUM, group)
        sum2 = _all_reduce((2 * (z - m[:, None])).exp().sum(-1), dist.ReduceOp.SUM, group)
        out[s:s + chunk_tokens] = sum2.log() - 2 * sum1.log()
    return out.view(logits.shape[:-1])
