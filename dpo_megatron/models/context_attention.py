"""Context-parallel core attention of the local layer spec (CPU/gloo, and GPUs without
transformer-engine; with transformer-engine megatron-core's ``TEDotProductAttention`` does CP
itself on the same load-balanced batch split).

Each CP rank holds L / CP tokens of every row (``data.context_split``: chunks r and 2CP-1-r of
every unit). Per layer, keys and values are all-gathered over the CP group (Llama 3's choice,
Dubey et al. 2024, Sec. 3.3.2), so every rank's queries attend to the whole row; the backward
all-gathers them again and reduce-scatters their gradients back to the ranks that hold the
tokens. Only this rank's L / CP keys and values are kept between forward and backward, so every
saved tensor of a layer shrinks with CP.

Which key a query may see is decided from token coordinates, not from their place in the row:
key s is visible to query t iff both belong to the same packed unit (``segment_ids``),
``position_ids[s] <= position_ids[t]``, and the key's branch is 0 or the query's (shared-prompt
pairs: a rejected token sees the prompt and earlier rejected tokens, never a chosen one). This is
``models.attention.visible_keys``' rule with positions in place of row indices: positions count
from 0 inside each unit and grow along each branch (a unit's 2 x CP padding comes after its last
position), so the rule holds whatever order the chunks were gathered in.

The kernel is blockwise attention with an online softmax (Milakov & Gimelshein 2018; the
FlashAttention recurrence, Dao et al. 2022, Alg. 1, and its backward, Alg. 2, recomputing the
probabilities from the saved log-sum-exp): the visibility is computed per [block x block] tile
from the coordinates and fully hidden tiles are skipped (about half of them under a causal
mask; the host reads which ones once per forward pass, :func:`visible_tiles`, never per tile),
so neither an [L / CP, L] mask nor the scores are ever held: per layer only q, k, v, the output
and the log-sum-exp are kept for backward. All of it in the model dtype with fp32
accumulation for bf16 / fp16 inputs.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from dpo_megatron.parallel.context import (
    all_gather_dim,
    context_parallel_group,
    gather_along_sequence,
    reduce_scatter_dim,
)

BLOCK = 512
"""Query and key tokens per tile of the blockwise kernel."""


@torch.no_grad()
def context_parallel_coordinates(
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    branch_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """This CP rank's query coordinates and the all-gathered key coordinates, in one tensor (the
    ``attention_mask`` argument of :class:`ContextParallelAttention`: a tensor, so megatron-core's
    recompute saves it like any activation).

    Args:
        position_ids: [R, Lq] positions of this rank's tokens inside their unit (Lq = L / CP).
        segment_ids: [R, Lq] unit ids of packed rows, or None (one sequence per row).
        branch_ids: [R, Lq] shared-prompt branches (0 prompt, 1 chosen, 2 rejected), or None.

    Returns:
        [R', 3, Lq + L] int64: (position, segment, branch) of the Lq queries, then of the L keys
        in :func:`~dpo_megatron.parallel.context.gather_along_sequence` order. R' = 1 for padded
        rows whose positions are the same in every row (broadcast over the rows).
    """
    rows = position_ids
    if (
        segment_ids is None
        and branch_ids is None
        and bool((position_ids == position_ids[:1]).all())
    ):
        rows = position_ids[:1]
    zeros = torch.zeros_like(rows)
    query = torch.stack(
        [
            rows,
            zeros if segment_ids is None else segment_ids.to(rows.dtype),
            zeros if branch_ids is None else branch_ids.to(rows.dtype),
        ],
        1,
    )
    keys = gather_along_sequence(query.permute(2, 0, 1).contiguous()).permute(1, 2, 0)
    return torch.cat([query, keys], dim=2)


def _visible(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[R', 3, bq], [R', 3, bk] coordinates -> [R', 1, bq, bk] bool, True = visible."""
    pos_q, seg_q, br_q = q[:, 0, :, None], q[:, 1, :, None], q[:, 2, :, None]
    pos_k, seg_k, br_k = k[:, 0, None, :], k[:, 1, None, :], k[:, 2, None, :]
    return ((pos_k <= pos_q) & (seg_k == seg_q) & ((br_k == 0) | (br_k == br_q))).unsqueeze(1)


_TILE_MAPS: dict[int, tuple] = {}
"""id(coords) -> (weak reference to coords, block, n_q, tiles): the visible tiles of the
coordinates of one micro-batch's forward, found by its first layer and reused by the others."""


def visible_tiles(coords: torch.Tensor, n_q: int, block: int) -> list[tuple[slice, slice]]:
    """The [block x block] tiles (query slice, key slice) in which some query sees some key under
    the coordinate rule; the others are skipped. ``coords`` [R', 3, n_q + n_k]
    (:func:`context_parallel_coordinates`).

    The tile map is computed on the device (one [R', block, n_k] comparison per query tile) and
    read by the host once, not once per tile (each read would wait for the device), and only
    once per set of coordinates: the layers of one forward pass share them.
    """
    hit = _TILE_MAPS.get(id(coords))
    if hit is not None and hit[0]() is coords and hit[1:3] == (block, n_q):
        return hit[3]
    n_k = coords.shape[2] - n_q
    n_kt = -(-n_k // block)
    keys = coords[:, :, n_q:]
    rows = []
    for qs in range(0, n_q, block):
        seen = _visible(coords[:, :, qs : min(qs + block, n_q)], keys).any(2).any(1).any(0)  # [n_k]
        rows.append(torch.nn.functional.pad(seen, (0, n_kt * block - n_k)).view(n_kt, block).any(1))
    tile_map = torch.stack(rows).tolist()  # the one host read
    tiles = [
        (slice(qs, min(qs + block, n_q)), slice(ks, min(ks + block, n_k)))
        for i, qs in enumerate(range(0, n_q, block))
        for j, ks in enumerate(range(0, n_k, block))
        if tile_map[i][j]
    ]
    key = id(coords)
    _TILE_MAPS[key] = (weakref.ref(coords, lambda _: _TILE_MAPS.pop(key, None)), block, n_q, tiles)
    return tiles


def _expand_groups(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, groups, s, hn] -> [b, groups * rep, s, hn] (grouped-query attention)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _reduce_groups(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, groups * rep, s, hn] -> [b, groups, s, hn], summing each group's heads."""
    if rep == 1:
        return t
    b, heads, s, hn = t.shape
    return t.view(b, heads // rep, rep, s, hn).sum(2)


class _BlockwiseAttention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) v by tiles (see the module docstring).

    q [b, heads, Sq, hn]; k, v [b, groups, Sk_local, hn], all-gathered along dim 2 over
    ``group`` (None: used as they are) to Sk; coords [R', 3, Sq + Sk] -> [b, heads, Sq, hn].
    """

    @staticmethod
    def forward(ctx, q, k_local, v_local, coords, scale, block, group):
        k, v = (
            (k_local, v_local)
            if group is None
            else (all_gather_dim(k_local, group, 2), all_gather_dim(v_local, group, 2))
        )
        n_q, rep = q.shape[2], q.shape[1] // k.shape[1]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        shape = q.shape[:3]
        m = q.new_full(shape, float("-inf"), dtype=acc_dtype)
        denom = q.new_zeros(shape, dtype=acc_dtype)
        acc = q.new_zeros(q.shape, dtype=acc_dtype)
        tiles = visible_tiles(coords, n_q, block)
        for qs, ks in tiles:
            visible = _visible(coords[:, :, qs], coords[:, :, n_q + ks.start : n_q + ks.stop])
            kb, vb = (_expand_groups(t[:, :, ks], rep) for t in (k, v))
            s = (q[:, :, qs] @ kb.transpose(-1, -2)).to(acc_dtype) * scale
            s = s.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m[:, :, qs], s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing seen yet
            p = (s - m_safe[..., None]).exp()
            alpha = (m[:, :, qs] - m_safe).exp()
            denom[:, :, qs] = denom[:, :, qs] * alpha + p.sum(-1)
            acc[:, :, qs] = acc[:, :, qs] * alpha[..., None] + (p.to(vb.dtype) @ vb).to(acc_dtype)
            m[:, :, qs] = m_new
        out = (acc / denom[..., None]).to(q.dtype)  # every query sees itself: denom > 0
        lse = m + denom.log()
        ctx.save_for_backward(q, k_local, v_local, coords, out, lse)
        ctx.scale, ctx.group, ctx.tiles = scale, group, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, coords, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        if group is not None:
            k, v = all_gather_dim(k, group, 2), all_gather_dim(v, group, 2)
        n_q, rep = q.shape[2], q.shape[1] // k.shape[1]
        acc_dtype = lse.dtype
        grad_out = grad_out.contiguous()
        delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # [b, heads, Sq]
        dq = torch.zeros_like(q, dtype=acc_dtype)
        dk = torch.zeros_like(k, dtype=acc_dtype)
        dv = torch.zeros_like(v, dtype=acc_dtype)
        for qs, ks in ctx.tiles:  # the forward's: no host read here
            visible = _visible(coords[:, :, qs], coords[:, :, n_q + ks.start : n_q + ks.stop])
            kb, vb = (_expand_groups(t[:, :, ks], rep) for t in (k, v))
            qb, gb = q[:, :, qs], grad_out[:, :, qs]
            s = (qb @ kb.transpose(-1, -2)).to(acc_dtype) * scale
            p = (s - lse[:, :, qs, None]).exp().masked_fill(~visible, 0.0)
            dv[:, :, ks] += _reduce_groups(p.transpose(-1, -2) @ gb.to(acc_dtype), rep)
            dp = gb.to(acc_dtype) @ vb.to(acc_dtype).transpose(-1, -2)
            ds = p * (dp - delta[:, :, qs, None]) * scale
            dq[:, :, qs] += ds @ kb.to(acc_dtype)
            dk[:, :, ks] += _reduce_groups(ds.transpose(-1, -2) @ qb.to(acc_dtype), rep)
        if group is not None:  # each rank's keys were read by every rank's queries
            dk, dv = reduce_scatter_dim(dk, group, 2), reduce_scatter_dim(dv, group, 2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    coords: torch.Tensor,
    scale: float,
    block: int = BLOCK,
    group=None,
) -> torch.Tensor:
    """Attention of ``query`` [b, heads, Sq, hn] over ``key`` / ``value`` [b, groups, Sk, hn]
    under the coordinate rule (:func:`context_parallel_coordinates`: [R', 3, Sq + Sk]), softmax
    scale ``scale``. With a CP ``group``, ``key`` / ``value`` are this rank's share and are
    all-gathered along the sequence (forward and backward; their gradients reduce-scattered).
    Returns [b, heads, Sq, hn]; differentiable in query, key and value."""
    return _BlockwiseAttention.apply(query, key, value, coords, scale, block, group)


class ContextParallelAttention(DotProductAttention):
    """Core attention over keys/values all-gathered across the CP group (see the module doc).

    Same inputs and output as megatron-core's ``DotProductAttention`` (query [sq, b, np, hn], key
    / value [sq, b, ng, hn] with sq = L / CP -> context [sq, b, np * hn]); ``attention_mask`` is
    :func:`context_parallel_coordinates`' tensor, built once per forward by ``ScoringGPTModel``. No
    attention dropout (the engine's dropout is 0), softmax offsets or sliding windows.
    """

    packed_format = "sbhd"
    """Packed rows stay rows (``models.attention.packed_format``); their CP share comes as
    ``data.context_split.LocalRows`` and reaches the kernel as coordinates."""

    def __init__(self, config, *args, **kwargs):
        # megatron-core's local attention refuses CP (its own CP is transformer-engine's); this
        # class does the CP part, so the parent is built for the per-rank computation.
        if config.softmax_type != "vanilla":  # refused at config time too (attention sinks)
            raise ValueError(
                f"context-parallel attention has no softmax offset (softmax_type="
                f"{config.softmax_type!r}): set parallel.context_parallel_size=1"
            )
        super().__init__(replace(config, context_parallel_size=1), *args, **kwargs)
        self.config = config

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None or packed_seq_params is not None or attention_mask is None:
            raise ValueError(
                "context-parallel local attention takes its coordinates as "
                "attention_mask (models.context_attention."
                "context_parallel_coordinates) and no bias or packed_seq_params"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        out = blockwise_attention(q, k, v, attention_mask, scale, group=context_parallel_group())
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def uses_context_parallel_attention(model: torch.nn.Module) -> bool:
    """True when ``model``'s layers attend with :class:`ContextParallelAttention` (so the model
    must build their coordinates); False for transformer-engine layers, which do CP themselves."""
    cached = getattr(model, "_uses_context_parallel_attention", None)
    if cached is None:
        cached = any(isinstance(m, ContextParallelAttention) for m in model.modules())
        model._uses_context_parallel_attention = cached
    return cached
