"""Context parallelism: which tokens of a sequence a rank holds, and the two collectives over the
context-parallel group. Knows nothing about DPO.

Layout (megatron-core's load-balanced one, ``get_batch_on_this_cp_rank``; Liu et al. 2023 ring
attention with the causal load balancing of Brandon et al. 2023): a span of ``n`` tokens is cut
into 2 x CP chunks of ``n / (2 CP)`` tokens and CP rank r holds chunks r and 2CP-1-r, in that order.
Under a causal mask chunk c attends to c + 1 chunks, so every rank does (r + 1) + (2CP - r) =
2CP + 1 chunk-pairs of attention work: the same on every rank.

Collectives (autograd-aware where a gradient flows through them):

* :func:`all_gather_dim` / :func:`reduce_scatter_dim`: the plain pair (no autograd) that the
  context-parallel attention kernel calls on keys / values in its forward and backward (as in
  Llama 3 training, Dubey et al. 2024, Sec. 3.3.2), so it keeps only this rank's share between
  them;
* :func:`gather_along_sequence` all-gathers a [s, ...] tensor along dim 0 as an autograd
  function; its backward reduce-scatters, so each rank gets the sum of every rank's gradient for
  the entries it holds (the attention's token coordinates go through it).
* :func:`sum_over_context_parallel` all-reduces a tensor whose entries each live on exactly one CP
  rank (zero elsewhere); its backward is the identity: every rank then computes the same loss from
  the same full tensor, and the loss is counted once (each rank's gradient reaches only the tokens
  it holds; DDP sums the ranks' parameter gradients over the data-parallel-with-context group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def context_parallel_group():
    """megatron-core's context-parallel group, or None when CP is 1 or groups are not built."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def context_parallel_rank_and_size() -> tuple[int, int]:
    """(CP rank, CP size); (0, 1) without context parallelism."""
    group = context_parallel_group()
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def chunk_positions(length: int, rank: int, size: int) -> torch.Tensor:
    """Positions (0..length-1) of a span that CP rank ``rank`` of ``size`` holds, in its order.

    Example: length 8, size 2 -> rank 0: [0, 1, 6, 7], rank 1: [2, 3, 4, 5].

    Raises:
        ValueError: ``length`` is not a multiple of 2 x ``size``.
    """
    if size == 1:
        return torch.arange(length)
    if length % (2 * size):
        raise ValueError(
            f"a span of {length} tokens cannot be cut into 2 x CP = {2 * size} equal "
            f"chunks: pad it to a multiple of {2 * size}"
        )
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def all_gather_dim(local: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim`` over ``group`` (rank order), no autograd: [.., s, ..] ->
    [.., CP * s, ..]."""
    moved = local.movedim(dim, 0).contiguous()
    out = moved.new_empty((dist.get_world_size(group) * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(full: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` of ``full`` [.., CP * s, ..], each rank keeping its own s slice along
    ``dim`` (the adjoint of :func:`all_gather_dim`), no autograd."""
    moved = full.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // dist.get_world_size(group), *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim)


class _GatherAlongSequence(torch.autograd.Function):
    """[s, ...] on each CP rank -> [CP * s, ...] (rank order); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        return all_gather_dim(local, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.group), None


def gather_along_sequence(local: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather ``local`` [s, ...] over the CP group along dim 0 -> [CP * s, ...], rank r's
    tokens at rows r * s .. (r + 1) * s - 1. Differentiable (backward: reduce-scatter of the
    gradient). Identity without context parallelism."""
    group = group if group is not None else context_parallel_group()
    if group is None:
        return local
    return _GatherAlongSequence.apply(local, group)


class _SumOverContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, group):
        out = values.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_context_parallel(values: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) of ``values`` over the CP group, for tensors whose every entry is non-zero
    on at most one CP rank (per-token log-probs in the per-sequence layout). Backward: identity
    (see the module docstring for why the loss is then counted once). Identity without CP."""
    group = group if group is not None else context_parallel_group()
    if group is None:
        return values
    return _SumOverContextParallel.apply(values, group)


def is_first_context_parallel_rank(group: object | None = None) -> bool:
    """True on CP rank 0 (and always without context parallelism)."""
    group = group if group is not None else context_parallel_group()
    return group is None or dist.get_rank(group) == 0
