"""Per-token log-probabilities from vocab-parallel logits, reduced across TP ranks.

Each tensor-parallel rank holds logits for a contiguous slice of the vocabulary. The
log-softmax needs the max and the sum of exponentials over the *whole* vocabulary, and the
target token's logit lives on exactly one rank, so three all-reduces over the TP group (max, sum,
sum) give exact log-probs without ever gathering the vocabulary:

    log p(y_t) = z_t[y_t] - (m_t + log sum_v exp(z_t[v] - m_t)),   m_t = max_v z_t[v]

(the standard log-sum-exp identity; the same decomposition as megatron-core's
``vocab_parallel_cross_entropy``). Everything is computed in fp32 for bf16/fp16/fp32 logits (fp64
stays fp64).

Two entry points:

* :func:`vocab_parallel_token_logps` takes logits. The fp32 copy is made one chunk of rows at a
  time, and backward recomputes the softmax from the saved (model-dtype) logits and the saved
  per-token log-sum-exp, so no fp32 [tokens, vocab/TP] tensor outlives a chunk; a caller that
  hands its logits over (``consume_logits``) gets their gradient written into them.
* :func:`vocab_parallel_linear_logps` takes the hidden states and the LM-head weight (what the
  training step uses). It never holds the [tokens, vocab/TP] logits: each chunk of rows is
  projected, reduced and dropped, and backward projects it again (one more LM-head matmul) to
  form that chunk's gradient, so only the hidden states [tokens, h] and the log-sum-exp are saved.
  This is the "fused linear cross-entropy" of Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989,
  sec. 3.3) applied to log-probs; at SmolLM2's 49,152-token vocabulary the logits are 85x the
  size of the hidden states they come from. For a bf16 model its matmul accumulates and writes
  fp32 logits (:func:`_matmul_wide`), so no logit is rounded to bf16. The unfused head
  (``model.fused_lm_head=false``) takes the output layer's logits in the model dtype, as
  megatron-core makes them: there the logits are bf16-rounded before the fp32 log-softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

LOGITS_CHUNK_ELEMENTS = 2**22
"""Logits per chunk of :func:`vocab_parallel_token_logps` and :func:`vocab_parallel_log_sum_p2`
(16 MiB in fp32; 85 rows for SmolLM2 at TP 1). Below glibc's largest mmap threshold (32 MiB), so
on the CPU each chunk's temporary comes from the heap and the next chunk reuses it; a larger one
is mapped fresh for every chunk, and the kernel faults in and zeroes each of its pages."""


def _chunk_rows(chunk_tokens: int | None, shard: int) -> int:
    """Rows per chunk: ``chunk_tokens`` when given, else :data:`LOGITS_CHUNK_ELEMENTS` over the
    vocabulary shard (at least 1)."""
    return chunk_tokens if chunk_tokens else max(1, LOGITS_CHUNK_ELEMENTS // max(shard, 1))


DEFAULT_CHUNK_ELEMENTS = 2**24
"""Logits per chunk of :func:`vocab_parallel_linear_logps` (64 MiB in fp32): the rows of a chunk
are this over the vocabulary shard (341 rows for SmolLM2 at TP 1)."""


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 stays fp64 (for gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _target_in_shard(labels: torch.Tensor, vocab_start: int, shard_size: int):
    """(local index clamped into the shard, bool mask of targets owned by this rank)."""
    owned = (labels >= vocab_start) & (labels < vocab_start + shard_size)
    local = (labels - vocab_start).clamp(0, shard_size - 1)
    return local, owned


def _chunk_max_and_sum_exp(z: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_v z [c], sum_v exp(z - max) [c]) over the whole vocabulary of a chunk's
    compute-dtype logits z [c, V/TP]."""
    m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
    # exp in place: one [c, V/TP] temporary, not two (the same values)
    return m, _all_reduce(torch.sub(z, m[:, None]).exp_().sum(dim=-1), dist.ReduceOp.SUM, group)


def _log_sum_p2_from(
    z: torch.Tensor, m: torch.Tensor, sum_exp: torch.Tensor, group
) -> torch.Tensor:
    """log sum_v p_v^2 [c], given the chunk's :func:`_chunk_max_and_sum_exp`."""
    sum2 = _all_reduce(torch.sub(z, m[:, None]).mul_(2).exp_().sum(-1), dist.ReduceOp.SUM, group)
    return sum2.log() - 2 * sum_exp.log()


def _chunk_logps(
    z: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, group, with_log_sum_p2: bool = False
):
    """One chunk's (log p(label) [c], log-sum-exp [c], log sum_v p_v^2 [c] or None) from its
    compute-dtype logits z [c, V/TP] (z is not modified)."""
    m, sum_exp = _chunk_max_and_sum_exp(z, group)
    lse = m + sum_exp.log()
    target = z.gather(-1, local[:, None]).squeeze(-1)
    # where, not multiply: an unowned target's clamped index may be a -inf padding column.
    target = _all_reduce(torch.where(owned, target, 0.0), dist.ReduceOp.SUM, group)
    p2 = _log_sum_p2_from(z, m, sum_exp, group) if with_log_sum_p2 else None
    return target - lse, lse, p2


def _chunk_log_sum_p2(z: torch.Tensor, group) -> torch.Tensor:
    """log sum_v p_v^2 [c] of one chunk's compute-dtype logits z [c, V/TP]."""
    return _log_sum_p2_from(z, *_chunk_max_and_sum_exp(z, group), group)


def _chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    local: torch.Tensor,
    owned: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d(sum_t grad_t log p(y_t)) / dz [c, V/TP] = grad_t (1[v == y_t] - softmax(z_t)_v), this
    rank's vocabulary slice (compute dtype), written into ``out`` when given (which may be
    ``z`` itself): the chunk is made in place, no [c, V/TP] temporary (each is a fresh
    allocation the kernel maps and zeroes on the CPU)."""
    g = grad[:, None]
    chunk = torch.sub(z, lse[:, None], out=out) if out is not None else z - lse[:, None]
    chunk.exp_().mul_(-g)  # exp(z - lse) * -g: the bits of -exp(z - lse) * g
    return chunk.scatter_add_(-1, local[:, None], g * owned[:, None])


class _VocabParallelTokenLogps(torch.autograd.Function):
    """logits [N, V/TP], labels [N] -> log p(label) [N] fp32 (see module docstring). With
    ``consume_logits`` backward writes the gradient into the logits' own memory."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, chunk_tokens, consume_logits):
        n, shard = logits.shape
        dtype = _compute_dtype(logits)
        logps = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        local, owned = _target_in_shard(labels, vocab_start, shard)
        for s in range(0, n, chunk_tokens):
            rows = slice(s, s + chunk_tokens)
            logps[rows], lse[rows], _ = _chunk_logps(
                logits[rows].to(dtype), local[rows], owned[rows], group
            )
        ctx.save_for_backward(logits, local, owned, lse)
        ctx.chunk_tokens, ctx.consume_logits = chunk_tokens, consume_logits
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        logits, local, owned, lse = ctx.saved_tensors
        # A chunk's gradient needs only that chunk's logits: written over them when the caller
        # hands the logits over, no second [N, V/TP] tensor.
        grad_logits = logits if ctx.consume_logits else torch.empty_like(logits)
        grad_logps = grad_logps.to(lse.dtype)
        in_place = grad_logits.dtype == lse.dtype  # else each chunk is made, then rounded
        for s in range(0, logits.shape[0], ctx.chunk_tokens):
            rows = slice(s, s + ctx.chunk_tokens)
            chunk = _chunk_grad(
                logits[rows].to(lse.dtype),
                lse[rows],
                grad_logps[rows],
                local[rows],
                owned[rows],
                out=grad_logits[rows] if in_place else None,
            )
            if not in_place:
                grad_logits[rows] = chunk
        return grad_logits, None, None, None, None, None


def _tp_context(group) -> tuple[object | None, int]:
    from megatron.core import parallel_state

    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group) if group is not None else 0
    return group, rank


def vocab_parallel_token_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    chunk_tokens: int | None = None,
    consume_logits: bool = False,
) -> torch.Tensor:
    """log p(labels[..., t] | context) for every position, from this rank's vocabulary shard.

    Args:
        logits: [..., V/TP] logits for this TP rank's contiguous vocabulary slice (any float
            dtype; the slice of rank r starts at r * V/TP, megatron-core's layout).
        labels: [...] int64 target token ids in the full vocabulary (already shifted: the
            target of position t is token t+1).
        group: TP process group (default: megatron-core's tensor-model-parallel group).
        chunk_tokens: rows converted to fp32 at a time (bounds peak memory); default
            :data:`LOGITS_CHUNK_ELEMENTS` over V/TP.
        consume_logits: the caller hands the logits over: nothing reads them after this
            function's backward, which then writes their gradient into their memory (one
            [..., V/TP] tensor less at the start of backward: 0.5 GiB for SmolLM2's ~2,600
            scored tokens in fp32). Their values are gone after backward.

    Returns:
        [...] log-probabilities in nats, fp32 (fp64 for fp64 logits). Differentiable w.r.t.
        ``logits``. Columns with -inf logits (vocabulary padding) get probability 0.
    """
    group, rank = _tp_context(group)
    shard = logits.shape[-1]
    flat = _VocabParallelTokenLogps.apply(
        logits.reshape(-1, shard),
        labels.reshape(-1),
        group,
        rank * shard,
        _chunk_rows(chunk_tokens, shard),
        consume_logits,
    )
    return flat.view(labels.shape)


@torch.no_grad()
def vocab_parallel_log_sum_p2(
    logits: torch.Tensor, group=None, chunk_tokens: int | None = None
) -> torch.Tensor:
    """log sum_v p_v^2 per position, the normaliser of the WPO weights (Zhou et al.
    2024, arXiv:2406.11827, Sec. 3; used by ``dpo_megatron.losses.reductions.wpo_weights``).

    log sum_v p_v^2 = logsumexp_v(2 z_v) - 2 logsumexp_v(z_v), both sums all-reduced over TP.
    Shapes: logits [..., V/TP] -> [...] fp32. No gradient (WPO weights are constants).
    """
    group, _ = _tp_context(group)
    flat = logits.reshape(-1, logits.shape[-1])
    chunk_tokens = _chunk_rows(chunk_tokens, flat.shape[-1])
    out = torch.empty(flat.shape[0], dtype=_compute_dtype(logits), device=logits.device)
    for s in range(0, flat.shape[0], chunk_tokens):
        out[s : s + chunk_tokens] = _chunk_log_sum_p2(
            flat[s : s + chunk_tokens].to(out.dtype), group
        )
    return out.view(logits.shape[:-1])


class HeadLogps(NamedTuple):
    """What :func:`vocab_parallel_linear_logps` returns: ``token_logps`` [n] (nats, fp32,
    differentiable) and ``log_sum_p2`` [n] (fp32, no gradient; None unless asked for)."""

    token_logps: torch.Tensor
    log_sum_p2: torch.Tensor | None


_MM_OUT_DTYPE = True
"""Whether ``torch.mm(..., out_dtype=)`` is still worth trying on CUDA (found missing once, it is
not tried again for every chunk of every step)."""


def _matmul_wide(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] @ b [k, n] with ``dtype`` (fp32 for bf16 inputs) accumulation *and* output.

    A bf16 matmul rounds its output to bf16: a logit near 20 moves by up to 0.06 nats, which
    DPO's log-ratios would see as noise. On CUDA the bf16 GEMM writes fp32 directly
    (``out_dtype``, no wider copy of the weight); where that overload is missing (the CPU, older
    torch) the inputs are widened first, one chunk at a time: the same products, the same fp32
    accumulation."""
    global _MM_OUT_DTYPE
    if a.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda and _MM_OUT_DTYPE:
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False  # this torch lacks the overload: widen from now on
    return torch.mm(a.to(dtype), b.to(dtype))


def _head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, valid_columns: int, dtype: torch.dtype
) -> torch.Tensor:
    """One chunk's logits [c, V/TP] in the compute dtype (fp32 for a bf16 model: the LM head's
    matmul accumulates and writes fp32, :func:`_matmul_wide`); vocabulary padding columns (from
    ``valid_columns`` on) are -inf, as the output layer's padding hook makes them
    (``models.gpt``)."""
    z = _matmul_wide(hidden, weight.t(), dtype)
    if valid_columns < z.shape[1]:
        z[:, valid_columns:] = float("-inf")
    return z


class _LinearTokenLogps(torch.autograd.Function):
    """hidden [n, h], weight [V/TP, h], labels [n] -> (log p(label) [n], log sum p^2 [n] or
    None), the logits one chunk of rows at a time (module docstring)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, labels, group, vocab_start, valid_columns, chunk_rows, with_log_sum_p2
    ):
        n, shard = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(hidden)
        logps = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        log_sum_p2 = torch.empty(n, dtype=dtype, device=hidden.device) if with_log_sum_p2 else None
        local, owned = _target_in_shard(labels, vocab_start, shard)
        for s in range(0, n, chunk_rows):
            rows = slice(s, s + chunk_rows)
            z = _head_logits(hidden[rows], weight, valid_columns, dtype)
            logps[rows], lse[rows], p2 = _chunk_logps(
                z, local[rows], owned[rows], group, with_log_sum_p2
            )
            if p2 is not None:
                log_sum_p2[rows] = p2
        ctx.save_for_backward(hidden, weight, local, owned, lse)
        ctx.chunk_rows, ctx.valid_columns = chunk_rows, valid_columns
        if log_sum_p2 is not None:
            ctx.mark_non_differentiable(log_sum_p2)
        return logps, log_sum_p2

    @staticmethod
    def backward(ctx, grad_logps, _grad_log_sum_p2):
        hidden, weight, local, owned, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The weight gradient sums over every chunk: kept in the compute dtype (fp32 for bf16).
        grad_weight = (
            torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
            if need_weight
            else None
        )
        grad_logps = grad_logps.to(lse.dtype)
        for s in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(s, s + ctx.chunk_rows)
            z = _head_logits(hidden[rows], weight, ctx.valid_columns, lse.dtype)
            grad_z = _chunk_grad(z, lse[rows], grad_logps[rows], local[rows], owned[rows], out=z)
            grad_z = grad_z.to(hidden.dtype)
            del z
            if need_hidden:
                torch.mm(grad_z, weight, out=grad_hidden[rows])
            if need_weight:
                if grad_weight.dtype == hidden.dtype:
                    grad_weight.addmm_(grad_z.t(), hidden[rows])
                else:
                    grad_weight += torch.mm(grad_z.t(), hidden[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def vocab_parallel_linear_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    valid_columns: int | None = None,
    log_sum_p2: bool = False,
    group=None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> HeadLogps:
    """log p(labels[t]) from the hidden states and this rank's LM-head shard, without the logits.

    Equal to ``vocab_parallel_token_logps(hidden @ weight.T, labels)`` (up to the rounding of
    the matmul's row blocking), but the [n, V/TP] logits exist one chunk of rows at a time, in
    forward and in backward (module docstring). The caller hands the same ``hidden`` to every TP
    rank and reduces its gradient over TP (megatron-core's ``copy_to_tensor_model_parallel_
    region``, as ``ColumnParallelLinear`` does).

    Args:
        hidden: [n, h] the scored positions' final hidden states (model dtype).
        weight: [V/TP, h] this TP rank's rows of the output weight (the word embeddings when
            tied); its gradient is accumulated by autograd as for the output layer.
        labels: [n] int64 target ids in the full vocabulary.
        valid_columns: this rank's columns that hold real tokens (the rest is vocabulary
            padding: probability 0); default all.
        log_sum_p2: also return log sum_v p_v^2 per position (WPO weights:
            :func:`vocab_parallel_log_sum_p2`).
        group: TP process group (default: megatron-core's).
        chunk_elements: logits per chunk (rows = this over V/TP, at least 1).

    Returns:
        :class:`HeadLogps` of [n] fp32 tensors (fp64 for fp64 inputs), nats.

    Raises:
        ValueError: ``hidden`` and ``weight`` disagree on h, or ``labels`` is not [n].
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [n, h] and weight [V/TP, h] expected, got "
            f"{list(hidden.shape)} and {list(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels [{hidden.shape[0]}] expected, got {list(labels.shape)}")
    group, rank = _tp_context(group)
    shard = weight.shape[0]
    valid = shard if valid_columns is None else valid_columns
    rows = max(1, chunk_elements // shard)
    logps, p2 = _LinearTokenLogps.apply(
        hidden, weight, labels, group, rank * shard, valid, rows, log_sum_p2
    )
    return HeadLogps(logps, p2)
