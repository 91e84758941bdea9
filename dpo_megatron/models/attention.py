"""Core attention: one module for padded rows, packed rows and shared-prompt pairs, every kernel.

A padded micro-batch needs no mask (one causal sequence per row). Packed rows carry a
``PackedLayout`` (``dpo_megatron.data.batch``): per position a segment id (one per packed unit)
and a branch id (0 prompt / plain, 1 chosen, 2 rejected), and the same information as attention
*spans* (query range -> key ranges, bottom-right causal). Query t sees key s iff they are in the
same segment, s <= t, and s is in the prompt or in t's own branch.

The layout reaches the core attention through megatron-core's own seam for packed sequences,
``packed_seq_params`` (:class:`PackedSequenceParams`, a ``PackedSeqParams`` that also holds the
layout and a per-micro-batch cache of what kernels derive from it). megatron-core passes that
object down to every layer by reference and its activation recompute captures it in a closure
(``tensor_parallel.checkpoint`` only saves tensor arguments, so ``attention_mask`` stays None):
a recomputed layer sees the layout of its own micro-batch, even when the pipeline has run other
micro-batches' forwards in between.

Kernels of the local spec (``model.local_attention``):

* ``sdpa``: torch ``scaled_dot_product_attention``. Padded rows: ``is_causal``. Packed rows: one
  call per micro-batch and layer, never a mask (:func:`packed_attention`): on CUDA in fp16 /
  bf16 torch's varlen flash-attention over the spans (:func:`varlen_attention`; a shared-prompt
  rejected span attends to its [prompt ; rejected] keys gathered by ``kv_index``, bottom-right
  causal), elsewhere one ``is_causal`` call over the spans laid out as square rows
  (:func:`span_attention`). Grouped-query keys go as ``enable_gqa`` where a fused kernel takes
  it and expanded where CUDA's memory-efficient kernel must serve (:func:`sdpa`), so SDPA's
  math kernel is never needed. Forward and backward on CPU and GPU.
* ``flex``: torch FlexAttention with a ``BlockMask`` built from the segment and branch ids (no
  [L, L] mask: fully masked 128 x 128 blocks are skipped). Compiled with Triton on CUDA; on CPU
  torch runs it eagerly and forward-only (no backward), so it serves reference / evaluation
  passes there.
* ``megatron``: megatron-core's unfused ``DotProductAttention`` with the dense [R, 1, L, L]
  mask: the reference implementation (scores are materialised; small models only).
* ``auto``: ``flex`` on CUDA, ``sdpa`` elsewhere.

With transformer-engine the layout is megatron-core's THD format: one row per micro-batch,
``cu_seqlens_q`` / ``cu_seqlens_kv`` from the spans (:func:`packed_seq_params`), and for shared
prompts :class:`TE core attention <te_core_attention>` gathers each rejected span's
[prompt ; rejected] keys (``kv_index``) and calls TE with ``cu_seqlens_q != cu_seqlens_kv`` and a
bottom-right causal mask.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from dpo_megatron.data.batch import SpanRows, span_rows
from dpo_megatron.models.config import LOCAL_ATTENTIONS as LOCAL_ATTENTION
from dpo_megatron.models.kv_cache import KVCache
from dpo_megatron.parallel.device import is_cuda
from dpo_megatron.utils.saved_activations import recomputable


def resolve_local_attention(name: str) -> str:
    """``model.local_attention`` -> the kernel used: ``auto`` is ``flex`` on CUDA, else ``sdpa``.

    Raises:
        ValueError: an unknown name.
    """
    if name not in LOCAL_ATTENTION:
        raise ValueError(
            f"model.local_attention must be one of {', '.join(LOCAL_ATTENTION)}, got {name!r}"
        )
    if name == "auto":
        return "flex" if is_cuda() else "sdpa"
    return name


# ----------------------------------------------------------------------------------------------
# the layout as seen by the kernels


@dataclass
class PackedSequenceParams(PackedSeqParams):
    """megatron-core's ``PackedSeqParams`` for one micro-batch of packed rows.

    ``qkv_format`` is ``thd`` for transformer-engine (the inherited fields are then TE's: query
    and key boundaries of the stored tokens, which megatron-core's RoPE also reads) and ``sbhd``
    for the local spec (megatron-core then leaves the rows as they are). ``layout`` is the
    micro-batch's ``PackedLayout``; ``cache`` holds what kernels derive from it (a dense mask, a
    block mask), built by the first layer and reused by the others and by recompute.
    """

    layout: Any = None
    cache: dict = field(default_factory=dict, repr=False)

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per micro-batch (the layout is the same in every layer)."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


def packed_seq_params(layout, thd: bool) -> PackedSequenceParams:
    """The ``packed_seq_params`` of a micro-batch's ``PackedLayout`` (on the device).

    Args:
        layout: ``MicroBatch.packed``.
        thd: transformer-engine's THD format (one row of all tokens); else the local spec's rows.

    Raises:
        ValueError: THD asked for several rows per micro-batch.
    """
    if not thd:
        return PackedSequenceParams(qkv_format="sbhd", layout=layout)
    if layout.segment_ids.shape[0] != 1:
        raise ValueError(
            f"transformer-engine's THD format takes one packed row per micro-batch, "
            f"got {layout.segment_ids.shape[0]}: leave packing.row_length=0"
        )
    # Keys are stored in token order: the same boundaries as the queries (RoPE reads these).
    # A shared prompt's gathered keys are the TE core attention's business (te_core_attention).
    return PackedSequenceParams(
        qkv_format="thd",
        cu_seqlens_q=layout.cu_seqlens_q,
        cu_seqlens_kv=layout.cu_seqlens_q,
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_kv=layout.max_seqlen_q,
        layout=layout,
    )


def visible_keys(segment_ids: torch.Tensor, branch_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Dense visibility of packed rows: [R, 1, L, L] bool, True where query t may attend to key s.

    Args:
        segment_ids: [R, L] int; positions with the same id belong to one packed unit.
        branch_ids: [R, L] int, 0 = shared (prompt) / plain, 1 = chosen, 2 = rejected; None: all 0.

    Visible: same segment, s <= t, and branch(s) in {0, branch(t)}. Built on the ids' device.
    Example (one pair, prompt 2, chosen 1, rejected 1; branches [0, 0, 1, 2]): the rejected
    query (t=3) sees keys [1, 1, 0, 1] (the prompt and itself, not the chosen token).
    """
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    visible = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    if branch_ids is not None:
        key_branch = branch_ids[:, None, :]
        visible &= (key_branch == 0) | (key_branch == branch_ids[:, :, None])
    return visible.unsqueeze(1)


def attention_mask_from_segments(
    segment_ids: torch.Tensor, branch_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """megatron-core's mask convention of :func:`visible_keys`: [R, 1, L, L] bool, True = masked."""
    return ~visible_keys(segment_ids, branch_ids)


def span_visible_keys(spans, device: torch.device) -> torch.Tensor:
    """Dense visibility of one packed row given as attention spans (``data.batch.AttentionSpan``:
    query i of a span with Q queries and K keys sees its keys 0 .. K - Q + i): [1, 1, T, T]
    bool, True where query t may attend to key s (T: the spans' queries). Unlike
    :func:`visible_keys` it holds any tree of shared prefixes (``generation.prefix_tree``).

    Example: spans [0, 2) on keys [0, 2) and [2, 3) on keys [0, 1] ++ [2]: query 2 sees keys
    [1, 1, 1], query 1 sees [1, 1, 0].
    """
    total = spans[-1].q_end
    visible = torch.zeros(total, total, dtype=torch.bool)
    for span in spans:
        keys = torch.cat([torch.arange(b, e) for b, e in span.keys])
        n_q = span.q_end - span.q_start
        seen = torch.ones(n_q, len(keys), dtype=torch.bool).tril(len(keys) - n_q)
        visible[span.q_start : span.q_end, keys] = seen
    return visible.to(device)[None, None]


# ----------------------------------------------------------------------------------------------
# kernels


def gqa_by_expansion(device: torch.device, dtype: torch.dtype, masked: bool) -> bool:
    """True when grouped-query keys / values must be expanded to the query heads before SDPA
    (``repeat_interleave``), False when ``enable_gqa=True`` reaches a fused kernel.

    On CUDA only flash-attention takes ``enable_gqa``, and only for fp16 / bf16 without a mask;
    memory-efficient attention (fp32, or a mask) refuses it, so SDPA would fall back to its math
    kernel (the [heads, n_q, n_k] scores materialised and kept for backward). Expanded keys keep
    the memory-efficient kernel. On the CPU the fused (flash) kernel takes ``enable_gqa`` with or
    without a mask, in every dtype.
    """
    if device.type != "cuda":
        return False
    return masked or dtype not in (torch.float16, torch.bfloat16)


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with grouped-query keys the way a fused kernel takes
    them (:func:`gqa_by_expansion`).

    Args:
        query: [b, heads, s_q, hn]; key / value: [b, groups, s_k, hn] (heads a multiple of
            groups).
        scale: softmax scale (None: 1 / sqrt(hn)).
        is_causal: top-left causal (query i sees keys 0..i).
        attn_mask: bool, True = visible (broadcast to [b, heads, s_q, s_k]), or None.
        sinks: [heads] attention-sink logits (gpt-oss), or None: :func:`sink_attention`.

    Returns:
        [b, heads, s_q, hn]: softmax(q k^T * scale) v (Vaswani et al. 2017, eq. 1).
    """
    if sinks is not None:
        return sink_attention(query, key, value, scale, sinks, is_causal, attn_mask)
    groups = key.shape[1]
    if groups != query.shape[1] and gqa_by_expansion(
        query.device, query.dtype, attn_mask is not None
    ):
        key, value = (t.repeat_interleave(query.shape[1] // groups, dim=1) for t in (key, value))
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )


def sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    sinks: torch.Tensor,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with one sink logit per head in every query's softmax denominator (gpt-oss;
    transformers' ``eager_attention_forward`` of ``GptOssAttention``, megatron-core's
    ``softmax_type='learnable'``): ``out_i = sum_j exp(a_ij) v_j / (exp(sink) + sum_j
    exp(a_ij))`` with ``a_ij = q_i k_j * scale``.

    One fused ``scaled_dot_product_attention`` call: the sink is one more key that every query
    sees, with a zero value, whose score is exactly the sink. Each head gets a further
    dimension: 1 in every query, 0 in every real key (their scores are unchanged) and
    ``sink / scale`` in the sink key (whose other dimensions are 0), so the sink's gradient
    flows through that key. Grouped-query keys are expanded to the heads (each head has its
    own sink).

    Args:
        query: [b, heads, s_q, hn]; key / value: [b, groups, s_k, hn] / [..., hv].
        scale: softmax scale (None: 1 / sqrt(hn)).
        sinks: [heads] logits (any float dtype; cast to the query's).
        is_causal: top-left causal (query i sees keys 0..i); attn_mask: bool, True = visible,
            broadcast to [b, heads, s_q, s_k], or None (every key visible).

    Returns:
        [b, heads, s_q, hv].
    """
    b, heads, s_q, hn = query.shape
    s_k = key.shape[2]
    scale = hn**-0.5 if scale is None else scale
    if key.shape[1] != heads:
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    if is_causal:
        attn_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device).tril()
    if attn_mask is None:
        attn_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device)
    attn_mask = attn_mask.expand(*attn_mask.shape[:-2], s_q, s_k)
    attn_mask = torch.cat([attn_mask, attn_mask.new_ones(*attn_mask.shape[:-1], 1)], dim=-1)
    sink_logit = (sinks.to(query.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, 1, 1)
    q = torch.cat([query, query.new_ones(b, heads, s_q, 1)], dim=-1)
    k = torch.cat(
        [
            torch.cat([key, key.new_zeros(b, heads, s_k, 1)], dim=-1),
            torch.cat([key.new_zeros(b, heads, 1, hn), sink_logit], dim=-1),
        ],
        dim=2,
    )
    v = torch.cat([value, value.new_zeros(b, heads, 1, value.shape[-1])], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def causal_window_mask(
    n_q: int, n_k: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Bottom-right causal sliding-window visibility: [n_q, n_k] bool, True where query i (at
    key slot ``n_k - n_q + i``) may see key j: ``0 <= slot(i) - j <= window``. None without a
    window (``window`` None: plain causal attention, which ``is_causal`` serves).

    ``window`` is the number of earlier keys a query sees besides itself (megatron-core's
    ``window_size[0]``; HF's ``sliding_window`` minus 1). Example: n_q = n_k = 4, window 1:
    rows [1,0,0,0], [1,1,0,0], [0,1,1,0], [0,0,1,1].
    """
    if window is None:
        return None
    slot = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    distance = slot - torch.arange(n_k, device=device)[None, :]
    return (distance >= 0) & (distance <= window)


def span_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans,
    scale: float | None,
    rows: SpanRows | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed spans in one ``scaled_dot_product_attention`` call per bucket of rows
    of similar width, with no mask.

    The spans are laid out as square causal rows (:class:`~dpo_megatron.data.batch.SpanRows`:
    a span's keys, with its queries in the last slots), each bucket gathered into
    [N_b, heads, W_b, hn], and run with ``is_causal``: the flash kernel on the CPU
    (``enable_gqa``) and on CUDA in fp16 / bf16, memory-efficient attention on CUDA in fp32
    (keys expanded, :func:`sdpa`). Compute: N_b * W_b^2 / 2 scores per bucket, W_b its longest
    span's keys (a rejected span also recomputes its prompt's queries). On CUDA in fp16 / bf16
    the engine takes :func:`varlen_attention` instead.

    Args:
        query: [Tq, heads, hn], key / value: [Tk, groups, hn] in flat positions (heads a
            multiple of groups: grouped-query attention).
        spans: ``AttentionSpan`` list whose queries tile 0..Tq-1 in order and whose keys lie in
            0..Tk-1 (``PackedLayout.spans``); a span's queries attend to its key ranges,
            bottom-right causal.
        scale: softmax scale (None: 1 / sqrt(hn)).
        rows: the spans' :class:`SpanRows` on the query's device (``PackedLayout.rows``); None:
            built here from ``spans``.
        window: sliding window (earlier keys a query sees besides itself, as
            :func:`causal_window_mask`), or None. A row's key slots are consecutive positions of
            its unit (a rejected span's prompt then its own tokens), so the window is a band of
            slots: one [W, W] mask shared by every row instead of ``is_causal``.
        sinks: [heads] attention-sink logits or None (:func:`sdpa`).

    Returns:
        [Tq, heads, hn] attention output (softmax(q k^T * scale) v per span; Vaswani et al.
        2017, eq. 1); a padding span's positions hold another position's output (nothing reads
        them). With gradients on it is marked recomputable from the kernels' outputs, which
        their backward keeps (``utils.saved_activations``).
    """
    if rows is None:
        rows = span_rows(spans)
        rows = SpanRows(
            *(t.to(query.device) for t in (rows.query_index, rows.key_index, rows.output_index)),
            tuple((r.to(query.device), w) for r, w in rows.buckets),
        )
    kernel_outs = []  # per bucket: (the kernel's output, kept by its backward; rows; width)
    for bucket, width in rows.buckets:  # one call per bucket of rows of similar width
        n = bucket.shape[0]
        flat_q = rows.query_index.index_select(0, bucket)[:, :width].reshape(-1)
        flat_k = rows.key_index.index_select(0, bucket)[:, :width].reshape(-1)
        # [n, W, heads, hn] -> [n, heads, W, hn]: the fused CPU kernel takes the strided view.
        q = query.index_select(0, flat_q).view(n, width, *query.shape[1:]).transpose(1, 2)
        k, v = (
            t.index_select(0, flat_k).view(n, width, *t.shape[1:]).transpose(1, 2)
            for t in (key, value)
        )
        band = causal_window_mask(width, width, window, query.device)
        out = sdpa(
            q, k, v, scale, is_causal=width > 1 and band is None, attn_mask=band, sinks=sinks
        )
        kernel_outs.append((out, n, width))
    heads, hv = query.shape[1], value.shape[-1]  # values may be narrower (multi-latent)

    def flat_outputs() -> torch.Tensor:
        """The kernels' [n, heads, W, hv] outputs -> [Tq, heads, hv] in query order."""
        flat = [out.transpose(1, 2).reshape(n * width, heads, hv) for out, n, width in kernel_outs]
        return torch.cat(flat).index_select(0, rows.output_index)

    out = flat_outputs()
    # The output projection keeps its input for its weight gradient: copies of what the kernels
    # keep for their own backward, so it is made again from them (utils.saved_activations).
    return recomputable(out, flat_outputs) if torch.is_grad_enabled() else out


@functools.cache
def _takes_varlen_arguments(varlen_attn: Callable) -> bool:
    return {"scale", "window_size", "enable_gqa"} <= inspect.signature(
        varlen_attn
    ).parameters.keys()


def varlen_supported() -> bool:
    """True when this torch's ``torch.nn.attention.varlen.varlen_attn`` takes what
    :func:`varlen_attention` passes (a softmax scale, a causal window, grouped-query keys), as
    torch 2.13's does; older releases lack the module or those arguments."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return _takes_varlen_arguments(varlen_attn)


def packed_attention_route(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """How the ``sdpa`` kernel runs packed rows of queries on ``device`` in ``dtype``:
    ``varlen`` (:func:`varlen_attention`, flash-attention's varlen kernel) on CUDA in fp16 /
    bf16 with a head size flash-attention takes (a multiple of 8, at most 256) and a torch whose
    varlen call takes grouped-query keys (:func:`varlen_supported`), else ``rows``
    (:func:`span_attention`: the flash kernel on the CPU and on CUDA in fp16 / bf16,
    memory-efficient attention on CUDA in fp32)."""
    if (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and varlen_supported()
    ):
        return "varlen"
    return "rows"


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of packed spans in one call of torch's varlen flash-attention
    (``torch.nn.attention.varlen.varlen_attn``): every span at its own length, bottom-right
    causal (``window_size=(-1, 0)``: with Q queries and K keys query i sees keys 0..K-Q+i,
    flash-attention's convention, the spans' rule), grouped-query keys as they are.

    Args:
        query: [T, heads, hn], key / value: [T, groups, hn] in flat positions (fp16 / bf16 on
            CUDA).
        layout: the micro-batch's ``PackedLayout`` on the device: ``cu_seqlens_q`` /
            ``cu_seqlens_kv`` / ``max_seqlen_*``, and ``kv_index`` (shared prompts: each span's
            keys gathered span after span, a rejected span's prompt then its own).
        scale: softmax scale (None: 1 / sqrt(hn)).
        window: sliding window (earlier keys a query sees besides itself), or None: flash-
            attention's ``window_size=(window, 0)``, bottom-right aligned like the causal rule.

    Returns:
        [T, heads, hn].
    """
    from torch.nn.attention.varlen import varlen_attn

    if layout.kv_index is not None:
        key, value = key.index_select(0, layout.kv_index), value.index_select(0, layout.kv_index)
    return varlen_attn(
        query,
        key,
        value,
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.max_seqlen_q,
        layout.max_seqlen_kv,
        scale=scale,
        window_size=(-1 if window is None else window, 0),
        enable_gqa=key.shape[1] != query.shape[1],
    )


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout,
    scale: float | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``sdpa`` kernel on packed rows: one call per micro-batch and layer, the route of
    :func:`packed_attention_route`. Shapes, ``window`` and ``sinks`` as :func:`span_attention`;
    ``layout`` the micro-batch's ``PackedLayout`` on the device. Values narrower than the
    queries (multi-latent attention) and attention sinks take the rows route: varlen
    flash-attention wants one head size and has no sink."""
    route = packed_attention_route(query.device, query.dtype, query.shape[-1])
    if route == "varlen" and value.shape[-1] == query.shape[-1] and sinks is None:
        return varlen_attention(query, key, value, layout, scale, window)
    return span_attention(query, key, value, layout.spans, scale, layout.rows, window, sinks)


_FLEX: dict[str, Callable] = {}


def _flex_functions() -> tuple[Callable, Callable]:
    """(flex_attention, create_block_mask): compiled by torch.compile on CUDA (Triton kernels;
    the block mask is then built without an [L, L] intermediate), eager elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not is_cuda():
        return flex_attention, create_block_mask
    if not _FLEX:
        _FLEX["attention"] = torch.compile(flex_attention, dynamic=True)
        _FLEX["block_mask"] = torch.compile(create_block_mask, dynamic=True)
    return _FLEX["attention"], _FLEX["block_mask"]


def flex_block_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor | None = None):
    """FlexAttention ``BlockMask`` of packed rows: the rule of :func:`visible_keys` as a
    ``mask_mod``, for R rows of L positions (heads broadcast)."""
    _, create_block_mask = _flex_functions()
    seg = segment_ids

    if branch_ids is None:

        def mask_mod(b, h, q, k):
            return (seg[b, q] == seg[b, k]) & (k <= q)
    else:
        br = branch_ids.to(torch.int32)

        def mask_mod(b, h, q, k):
            return (seg[b, q] == seg[b, k]) & (k <= q) & ((br[b, k] == 0) | (br[b, k] == br[b, q]))

    rows, length = seg.shape
    return create_block_mask(mask_mod, rows, None, length, length, device=seg.device)


def flex_attention_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask, scale: float | None
) -> torch.Tensor:
    """FlexAttention over [R, heads, L, hn] queries (keys [R, groups, L, hn]) with a block mask.

    Raises:
        RuntimeError: training on the CPU (torch's FlexAttention has no CPU backward).
    """
    if (
        query.device.type == "cpu"
        and torch.is_grad_enabled()
        and (query.requires_grad or key.requires_grad)
    ):
        raise RuntimeError(
            "model.local_attention=flex cannot train on the CPU (torch's "
            "FlexAttention has no CPU backward): use sdpa (or auto) there"
        )
    flex_attention, _ = _flex_functions()
    return flex_attention(
        query,
        key,
        value,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def cached_attention(
    owner: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: KVCache,
    scale: float | None,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A generation forward of one layer: the new slots' keys and values join ``cache``
    under ``owner`` and the new queries attend to the slots they may see
    (:meth:`KVCache.visible`). A packed prefill (:meth:`KVCache.append_packed`) attends
    within its packed layout (:func:`packed_attention`: no padding computed); otherwise the
    queries meet the cache's keys in :func:`slot_attention`.

    Args:
        query: [n, R, heads, hn]; key / value: [n, R, groups, hn] of the new slots (RoPE
            applied); a packed prefill's are [T, 1, ...].
        scale: softmax scale (None: 1 / sqrt(hn)).
        window: the layer's sliding window (earlier keys a query sees besides itself) or None.
        sinks: [heads] attention-sink logits or None (:func:`sdpa`).

    Returns:
        [n, R, heads * hv].
    """
    sq, b = query.shape[0], query.shape[1]
    if cache.packed is not None:
        flat = [t[:, 0] for t in (query, key, value)]  # [T, heads or groups, hn]
        cache.store_packed(owner, flat[1], flat[2])
        out = packed_attention(*flat, cache.packed.layout, scale, window, sinks)
        return out.reshape(sq, b, -1)
    cache.update(owner, key, value)
    keys, values = cache.row_major(owner)
    return slot_attention(query, keys, values, cache.visible(window), scale, sinks)


def slot_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few new query slots per row to a row's cached slots (a decode step):
    softmax(q k^T * scale) v (Vaswani et al. 2017, eq. 1) written as two batched matmuls per
    key group, which read the cache's [groups, length, hn] views as they are. (The fused CPU
    kernel takes a dense mask slowly: about 1.3 ms for 8 rows of one query at 300 slots, 40 ms
    a decode step of a 30-layer model.) With attention sinks: :func:`sdpa`.

    Args:
        query: [n, R, heads, hn] (heads a multiple of groups: grouped-query attention).
        keys: [R, groups, S, hn]; values: [R, groups, S, hv].
        visible: [R, 1, n, S] bool, True where a query slot may attend to a key slot.
        scale: softmax scale (None: 1 / sqrt(hn)).
        sinks: [heads] attention-sink logits or None.

    Returns:
        [n, R, heads * hv].
    """
    n, rows, heads, hn = query.shape
    groups, slots = keys.shape[1], keys.shape[2]
    q = query.permute(1, 2, 0, 3)  # [R, heads, n, hn]
    if sinks is not None:
        out = sdpa(q, keys, values, scale, attn_mask=visible, sinks=sinks)
    else:
        # a group's heads are consecutive (megatron-core's grouped-query layout)
        per_group = heads // groups
        scores = torch.matmul(q.reshape(rows, groups, per_group * n, hn), keys.transpose(-1, -2))
        scores = scores.view(rows, groups, per_group, n, slots)
        scores.mul_(hn**-0.5 if scale is None else scale)
        scores.masked_fill_(~visible.view(rows, 1, 1, n, slots), float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(rows, groups, per_group * n, slots)
        out = torch.matmul(probs, values).view(rows, heads, n, values.shape[-1])
    return out.permute(2, 0, 1, 3).reshape(n, rows, -1)


class LocalAttention(DotProductAttention):
    """megatron-core's local core attention with the kernels of this module (see its docstring).

    Same inputs and output as ``DotProductAttention`` (query [sq, b, np, hn], key / value
    [sk, b, ng, hn] -> context [sq, b, np * hn]), same math (softmax(q k^T * scale) v), but the
    [b, np, sq, sk] scores and probabilities are neither materialised nor kept for backward
    (except with ``kernel="megatron"``): on SmolLM2-135M at 8 x 512 tokens that is 150 MB per
    layer. Packed rows come as ``packed_seq_params`` (:class:`PackedSequenceParams`). A sliding
    window of this layer (megatron-core's ``window_size`` / ``window_attn_skip_freq``, read per
    layer by the parent) is served by the ``sdpa`` kernel on padded and packed rows (a band mask,
    :func:`causal_window_mask`; varlen's ``window_size``); ``flex`` and ``megatron`` refuse it
    (at config time: ``models.transformer_config.check_sliding_window``; here again). Attention
    sinks (megatron-core's learnable softmax offset, gpt-oss) are served by the ``sdpa`` kernel
    on every route (:func:`sink_attention`) and by ``megatron``; ``flex`` refuses them. Features
    the kernels do not cover (a fixed off-by-one offset, query-key layer scaling, attention
    dropout, attention bias) fall back to the parent with the dense mask.

    Args:
        kernel: ``sdpa``, ``flex`` or ``megatron`` (:func:`resolve_local_attention`).
    """

    packed_format = "sbhd"
    """How this core attention takes packed rows (:func:`packed_format`)."""

    def __init__(
        self,
        *args,
        kernel: str = "sdpa",
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if kernel not in ("sdpa", "flex", "megatron"):
            raise ValueError(f"unknown local attention kernel {kernel!r}")
        self.kernel = kernel
        if v_channels is not None:
            # Multi-latent attention (megatron-core's MLA passes its head sizes): queries and
            # keys of k_channels, values and the output of v_channels per head.
            if kernel == "megatron":
                raise ValueError(
                    "multi-latent attention runs on the local sdpa or flex kernel: set "
                    "model.local_attention=sdpa"
                )
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        window_size = self.scale_mask_softmax.window_size
        self.window: int | None = None
        """Earlier keys a query sees besides itself in this layer's sliding window; None: full
        causal attention (megatron-core's ``window_size[0]`` where this layer is windowed)."""
        if window_size is not None:
            if kernel != "sdpa" or tuple(window_size)[1] != 0:
                raise ValueError(
                    f"sliding-window attention (window_size={tuple(window_size)}) is served by "
                    f"the local sdpa kernel with a causal window (right extent 0) only, not by "
                    f"{kernel!r}: set model.local_attention=sdpa"
                )
            self.window = int(window_size[0])
        if self.config.softmax_type == "learnable":
            # Each TP rank holds its heads' sinks; megatron-core 0.16 leaves the parameter
            # unmarked, and its gradient norm would count only TP rank 0's (a duplicate).
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        if kernel == "flex" and self.config.softmax_type == "learnable":
            raise ValueError(
                "attention sinks (softmax_type='learnable') are not served by the flex kernel: "
                "set model.local_attention=sdpa"
            )

    def sinks(self) -> torch.Tensor | None:
        """[heads/TP] attention-sink logits the ``sdpa`` kernel applies (megatron-core's
        learnable ``softmax_offset``); None without sinks or with the ``megatron`` kernel."""
        if self.kernel == "sdpa" and self.config.softmax_type == "learnable":
            return self.softmax_offset
        return None

    def _parent_handles(self, attention_bias) -> bool:
        return (
            self.kernel == "megatron"
            or (self.softmax_offset is not None and self.sinks() is None)
            or self.config.apply_query_key_layer_scaling
            or (self.training and self.attention_dropout.p > 0)
            or attention_bias is not None
        )

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
        if isinstance(packed_seq_params, KVCache):
            return self._cached_forward(query, key, value, attn_mask_type, packed_seq_params)
        layout = getattr(packed_seq_params, "layout", None)
        if packed_seq_params is not None and layout is None:
            raise ValueError(
                "the local attention reads packed rows from PackedSequenceParams "
                "(dpo_megatron.models.attention.packed_seq_params)"
            )
        if self._parent_handles(attention_bias):
            if layout is not None:
                attention_mask = packed_seq_params.cached(
                    "dense_mask",
                    lambda: attention_mask_from_segments(layout.segment_ids, layout.branch_ids),
                )
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, None
            )
        sq, b = query.shape[0], query.shape[1]
        if layout is not None and self.kernel == "sdpa":
            flat = [t.transpose(0, 1).reshape(-1, *t.shape[2:]) for t in (query, key, value)]
            out = packed_attention(*flat, layout, self.softmax_scale, self.window, self.sinks())
            out = out.view(b, sq, self.hidden_size_per_partition)
            return out.transpose(0, 1).contiguous()
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        if layout is not None:  # flex
            block_mask = packed_seq_params.cached(
                "block_mask", lambda: flex_block_mask(layout.segment_ids, layout.branch_ids)
            )
            out = flex_attention_rows(q, k, v, block_mask, self.softmax_scale)
        elif attention_mask is None and self.window is not None:
            band = causal_window_mask(q.shape[2], k.shape[2], self.window, q.device)
            out = sdpa(q, k, v, self.softmax_scale, attn_mask=band, sinks=self.sinks())
        elif attention_mask is None:
            out = sdpa(q, k, v, self.softmax_scale, is_causal=q.shape[2] > 1, sinks=self.sinks())
        elif self.window is not None:  # the band is on row indices, a dense mask on units
            raise ValueError(
                "sliding-window attention takes no dense attention_mask: pass packed rows as "
                "packed_seq_params (models.attention.packed_seq_params)"
            )
        else:
            out = sdpa(q, k, v, self.softmax_scale, attn_mask=~attention_mask, sinks=self.sinks())
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _cached_forward(self, query, key, value, attn_mask_type, cache: KVCache):
        """Generation: the new slots' keys and values join ``cache``
        (``models.kv_cache``), and the new queries attend to every slot they may see
        (:meth:`KVCache.visible`, this layer's window included) with the ``sdpa`` kernel
        whatever ``kernel`` is (the mask is small: [R, 1, n, slots]), attention sinks included;
        a fixed softmax offset and query-key layer scaling, which only the parent computes, take
        the parent with the same mask. Generation runs in eval mode (no attention dropout).

        Raises:
            ValueError: a sliding window in a layer the parent must compute.
        """
        learnable = self.config.softmax_type == "learnable"
        sinks = self.softmax_offset if learnable else None
        if (self.softmax_offset is not None and not learnable) or (
            self.config.apply_query_key_layer_scaling
        ):
            if self.window is not None:
                raise ValueError(
                    "cached generation of a sliding-window layer with a fixed softmax "
                    "offset or query-key layer scaling is not supported"
                )
            if cache.packed is not None:  # a packed prefill: the dense mask of its layout
                flat = [t[:, 0] for t in (key, value)]
                cache.store_packed(self, *flat)
                layout = cache.packed.layout  # its spans may share prefixes: no segment ids
                mask = cache.packed.cached(
                    "dense_mask", lambda: ~span_visible_keys(layout.spans, query.device)
                )
                return super().forward(query, key, value, mask, attn_mask_type, None, None)
            key, value = cache.update(self, key, value)
            visible = cache.visible(self.window)
            return super().forward(query, key, value, ~visible, attn_mask_type, None, None)
        return cached_attention(
            self, query, key, value, cache, self.softmax_scale, self.window, sinks
        )


SDPAttention = LocalAttention
"""The name this module's SDPA core attention had before the kernels were selectable."""


# ----------------------------------------------------------------------------------------------
# transformer-engine


def shared_prompt_thd_inputs(
    key: torch.Tensor, value: torch.Tensor, params: PackedSequenceParams
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """THD keys / values and TE arguments for shared-prompt pairs.

    Args:
        key, value: [T, groups, hn] in token order (THD, RoPE already applied).
        params: the micro-batch's :class:`PackedSequenceParams` (``layout.kv_index`` set).

    Returns:
        (key, value) gathered span after span ([K, groups, hn]: a rejected span's keys are its
        prompt's then its own), and the keyword arguments of TE's ``DotProductAttention``:
        ``qkv_format='thd'``, ``cu_seqlens_q`` (the spans' queries), ``cu_seqlens_kv`` (their
        gathered keys), ``max_seqlen_q`` / ``max_seqlen_kv`` and a bottom-right causal padding
        mask (query i of a span with Q queries and K keys sees keys 0 .. K - Q + i).
    """
    layout = params.layout
    index = layout.kv_index
    kwargs = dict(
        qkv_format="thd",
        attn_mask_type="padding_causal_bottom_right",
        cu_seqlens_q=layout.cu_seqlens_q,
        cu_seqlens_kv=layout.cu_seqlens_kv,
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_kv=layout.max_seqlen_kv,
    )
    return key.index_select(0, index), value.index_select(0, index), kwargs


def te_core_attention() -> type:
    """transformer-engine's core attention (megatron-core's ``TEDotProductAttention``) that also
    runs shared-prompt pairs: with ``layout.kv_index`` it gathers the keys / values of every span
    (:func:`shared_prompt_thd_inputs`) and calls TE's ``DotProductAttention`` with
    ``cu_seqlens_q != cu_seqlens_kv``; otherwise it is megatron-core's class unchanged.
    Requires transformer-engine (imported here, not at module import)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TEPackedAttention(TEDotProductAttention):
        packed_format = "thd"

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type,
            attention_bias=None,
            packed_seq_params=None,
            num_splits=None,
        ):
            if isinstance(packed_seq_params, KVCache):  # generation (not run on this stack)
                size = getattr(self, "window_size", None)
                window = None if size is None or size[0] < 0 else int(size[0])
                scale = getattr(self, "softmax_scale", None)
                return cached_attention(self, query, key, value, packed_seq_params, scale, window)
            layout = getattr(packed_seq_params, "layout", None)
            if layout is None or layout.kv_index is None:
                return super().forward(
                    query,
                    key,
                    value,
                    attention_mask,
                    attn_mask_type,
                    attention_bias,
                    packed_seq_params,
                    num_splits,
                )
            if attention_bias is not None:
                raise ValueError(
                    "shared-prompt pairs take no attention bias with transformer-engine"
                )
            key, value, kwargs = shared_prompt_thd_inputs(key, value, packed_seq_params)
            # TE's own DotProductAttention: megatron-core's wrapper maps only its mask enum,
            # which has no padding + bottom-right causal type.
            return super(TEDotProductAttention, self).forward(query, key, value, None, **kwargs)

    return TEPackedAttention


def packed_format(model: torch.nn.Module) -> str:
    """``thd`` when the model's core attention is transformer-engine's (packed rows then go as
    one THD row with ``cu_seqlens``), else ``sbhd`` (the local kernels read the layout).

    Raises:
        ValueError: a model with no core attention of this module.
    """
    formats = {
        m.packed_format
        for m in model.modules()
        if hasattr(m, "packed_format") and isinstance(m.packed_format, str)
    }
    if len(formats) != 1:
        raise ValueError(
            f"expected one packed format in the model's core attention, got "
            f"{sorted(formats) or 'none'}"
        )
    return formats.pop()


def core_attention_spec(local_attention: str, transformer_engine: bool):
    """The ``core_attention`` submodule of a layer spec: :func:`te_core_attention` with
    transformer-engine, else :class:`LocalAttention` with the resolved kernel.

    Raises:
        ValueError: an unknown ``local_attention``.
    """
    kernel = resolve_local_attention(local_attention)
    if transformer_engine:
        return te_core_attention()
    return ModuleSpec(module=LocalAttention, params={"kernel": kernel})
