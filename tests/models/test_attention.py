"""The attention kernels against one another and against the rule by hand: dense SDPA with the
visibility mask, the spans as square causal rows in one SDPA call, FlexAttention, megatron-core's
DotProductAttention, and the varlen inputs flash-attention and transformer-engine would get
(checked here by an explicit varlen computation, since neither runs on CPU); and which call each
path makes."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpo_megatron.data import PreferencePair
from dpo_megatron.data.batch import AttentionSpan
from dpo_megatron.data.packing import pack_pairs, pack_shared_prompt_pairs
from dpo_megatron.models.attention import (
    flex_attention_rows,
    flex_block_mask,
    gqa_by_expansion,
    packed_attention,
    packed_attention_route,
    packed_seq_params,
    resolve_local_attention,
    shared_prompt_thd_inputs,
    span_attention,
    varlen_attention,
    visible_keys,
)
from tests.engine import random_pairs, tiny_trainer
from tests.multirank import run_ranks

PAIRS = [
    PreferencePair((5, 6, 7), (8, 9, 2), (10, 2)),
    PreferencePair((11,), (12, 13, 14, 15, 2), (16, 17, 2)),
    PreferencePair((18, 19, 20, 21), (22, 2), (23, 24, 25, 2)),
]
HEADS, GROUPS, DIM = 4, 2, 8


def _layouts():
    return {
        "packed": pack_pairs(PAIRS, 0, row_length=40)[0].packed,
        "shared": pack_shared_prompt_pairs(PAIRS, 0, row_length=32)[0].packed,
        "shared_rows": pack_shared_prompt_pairs(PAIRS, 0, row_length=13)[0].packed,
    }


def _qkv(positions, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(positions, n, DIM, generator=g, requires_grad=grad)
        for n in (HEADS, GROUPS, GROUPS)
    ]


def _dense(q, k, v, layout):
    """Reference: SDPA over each row with the dense visibility mask ([T, heads, hn] flat)."""
    rows, length = layout.segment_ids.shape
    mask = visible_keys(layout.segment_ids, layout.branch_ids)  # [R, 1, L, L]
    q, k, v = (t.reshape(rows, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows * length, HEADS, DIM)


def _real(layout):
    """[T] bool: positions outside a row's padding tail."""
    real = torch.zeros(layout.segment_ids.numel(), dtype=torch.bool)
    for s in layout.spans:
        real[s.q_start : s.q_end] = not s.padding
    return real


def test_visibility_rule_by_hand():
    # One row: pair (prompt 2, chosen 2, rejected 2) then a plain sequence of 2 (branch 0).
    seg = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]])
    br = torch.tensor([[0, 0, 1, 1, 2, 2, 0, 0]])
    vis = visible_keys(seg, br)[0, 0].int().tolist()
    assert vis[3] == [1, 1, 1, 1, 0, 0, 0, 0]  # chosen: prompt + earlier chosen
    assert vis[5] == [1, 1, 0, 0, 1, 1, 0, 0]  # rejected: prompt + earlier rejected, no chosen
    assert vis[7] == [0, 0, 0, 0, 0, 0, 1, 1]  # another segment: only itself


@pytest.mark.parametrize("name", ["packed", "shared", "shared_rows"])
def test_span_attention_equals_dense_forward_and_backward(name):
    layout = _layouts()[name]
    real = _real(layout)
    q, k, v = _qkv(layout.segment_ids.numel(), grad=True)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))  # a loss on
    # the real positions only
    dense = _dense(q, k, v, layout)
    spans = span_attention(q, k, v, layout.spans, scale=None)
    torch.testing.assert_close(spans[real], dense[real], rtol=1e-6, atol=1e-6)
    grads = [
        torch.autograd.grad((out[real] * weights[real]).sum(), (q, k, v)) for out in (dense, spans)
    ]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["packed", "shared", "shared_rows"])
def test_flex_block_mask_equals_dense_forward(name):
    """FlexAttention runs eagerly and forward-only on CPU (compiled with Triton on CUDA)."""
    layout = _layouts()[name]
    rows, length = layout.segment_ids.shape
    q, k, v = _qkv(layout.segment_ids.numel())
    block_mask = flex_block_mask(layout.segment_ids, layout.branch_ids)
    rows_view = [t.reshape(rows, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
    flex = flex_attention_rows(*rows_view, block_mask, scale=None)
    flex = flex.transpose(1, 2).reshape(rows * length, HEADS, DIM)
    real = _real(layout)
    torch.testing.assert_close(flex[real], _dense(q, k, v, layout)[real], rtol=1e-5, atol=1e-6)


def test_flex_refuses_to_train_on_cpu():
    layout = _layouts()["packed"]
    q, k, v = (
        t.reshape(1, -1, *t.shape[1:]).transpose(1, 2)
        for t in _qkv(layout.segment_ids.numel(), grad=True)
    )
    with pytest.raises(RuntimeError, match="no CPU backward"):
        flex_attention_rows(q, k, v, flex_block_mask(layout.segment_ids), scale=None)


class SDPACalls:
    """Records every ``scaled_dot_product_attention`` call (then runs it) while active."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = F.scaled_dot_product_attention

        def spy(
            q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
        ):
            self.calls.append(
                dict(
                    mask=attn_mask,
                    is_causal=is_causal,
                    enable_gqa=enable_gqa,
                    heads=q.shape[-3],
                    groups=k.shape[-3],
                )
            )
            return real(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


@pytest.mark.parametrize("name", ["packed", "shared", "shared_rows"])
def test_packed_rows_make_one_maskless_sdpa_call_per_bucket_served_by_flash(name, monkeypatch):
    """The packed rows of a micro-batch: one SDPA call per bucket of rows of similar width (not
    one per span), no mask (so no boolean mask with grouped-query attention, which only SDPA's
    math kernel serves on CUDA), and the fused flash kernel serves it on CPU (``sdpa_kernel``
    refuses the others)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layout = _layouts()[name]
    q, k, v = _qkv(layout.segment_ids.numel(), grad=True)
    spy = SDPACalls(monkeypatch)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = packed_attention(q, k, v, layout, scale=None)
        out.sum().backward()
    assert len(layout.spans) >= 4 and len(spy.calls) == len(layout.rows.buckets) == 2
    for call in spy.calls:
        assert call["mask"] is None and call["is_causal"]
        assert (call["heads"], call["groups"], call["enable_gqa"]) == (HEADS, GROUPS, True)


def test_the_output_projection_keeps_no_copy_of_the_span_outputs():
    """Inside recompute_marked the attention output that the next product keeps is remade in
    backward from the kernels' outputs (which their backward keeps): the same bits and
    gradients as with the output kept."""
    from dpo_megatron.utils.saved_activations import recompute_marked

    layout = _layouts()["shared"]
    q, k, v = _qkv(layout.segment_ids.numel(), grad=True)
    w = torch.randn(HEADS * DIM, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
    grads = []
    for marked in (True, False):
        with recompute_marked() if marked else torch.enable_grad():
            out = span_attention(q, k, v, layout.spans, scale=None)
            projected = out.reshape(out.shape[0], -1) @ w
        kept = projected.grad_fn._saved_self
        assert (kept.data_ptr() != out.data_ptr()) is marked
        assert torch.equal(kept, out.reshape(out.shape[0], -1))
        grads.append(torch.autograd.grad(projected.sum(), (q, k, v, w)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_span_rows_cover_each_span_once():
    """Every real query position is read from the slot of its own query; rows are as wide as
    the most keys of a span (a rejected span: its prompt and itself), each bucket's rows cut to
    its widest span's, and a row is at least 3/4 as wide as its bucket."""
    layout = _layouts()["shared"]
    rows = layout.rows
    spans = [s for s in layout.spans if not s.padding]
    widths = [sum(e - b for b, e in s.keys) for s in spans]
    assert rows.query_index.shape == (len(spans), max(widths))
    assert sorted(r for b, _ in rows.buckets for r in b.tolist()) == list(range(len(spans)))
    for bucket, width in rows.buckets:
        assert width == max(widths[r] for r in bucket) <= 4 / 3 * min(widths[r] for r in bucket)
    # the buckets' slots end to end, as the attention lays its outputs
    flat = torch.cat([rows.query_index[b][:, :w].reshape(-1) for b, w in rows.buckets])
    real = _real(layout)
    positions = torch.arange(layout.segment_ids.numel())
    assert torch.equal(flat[rows.output_index][real], positions[real])


@pytest.mark.parametrize(
    "device, dtype, head_dim, route",
    [
        ("cuda", torch.bfloat16, 64, "varlen"),
        ("cuda", torch.float16, 128, "varlen"),
        ("cuda", torch.float32, 64, "rows"),
        ("cuda", torch.bfloat16, 260, "rows"),
        ("cuda", torch.bfloat16, 12, "rows"),
        ("cpu", torch.bfloat16, 64, "rows"),
        ("cpu", torch.float32, 64, "rows"),
    ],
)
def test_packed_route_by_device_and_dtype(device, dtype, head_dim, route):
    assert packed_attention_route(torch.device(device), dtype, head_dim) == route


def test_no_varlen_route_on_a_torch_whose_varlen_call_lacks_grouped_keys(monkeypatch):
    """torch releases before 2.13 have no varlen call or one without a scale, a causal window
    and grouped-query keys: packed rows then take the span rows (flash through SDPA)."""
    import torch.nn.attention.varlen as varlen

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise AssertionError("not called")

    cuda = torch.device("cuda")
    assert packed_attention_route(cuda, torch.bfloat16, 64) == "varlen"
    monkeypatch.setattr(varlen, "varlen_attn", older)
    assert packed_attention_route(cuda, torch.bfloat16, 64) == "rows"


@pytest.mark.parametrize(
    "device, dtype, masked, expand",
    [
        ("cuda", torch.bfloat16, False, False),  # flash-attention takes enable_gqa
        ("cuda", torch.bfloat16, True, True),  # a mask: memory-efficient attention, no GQA
        ("cuda", torch.float32, False, True),  # fp32: memory-efficient attention, no GQA
        ("cpu", torch.float32, True, False),
        ("cpu", torch.bfloat16, False, False),
    ],
)
def test_grouped_query_keys_expanded_only_where_cuda_needs_it(device, dtype, masked, expand):
    assert gqa_by_expansion(torch.device(device), dtype, masked) is expand


def _thd_reference(q, k, v, cu_q, cu_kv, window=None):
    """Varlen attention from cu_seqlens alone, bottom-right causal (and within ``window`` earlier
    keys, flash-attention's ``window_size=(window, 0)``), softmax written out."""
    out = torch.zeros_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i] : cu_q[i + 1]], k[cu_kv[i] : cu_kv[i + 1]]
        vs = v[cu_kv[i] : cu_kv[i + 1]]
        n_q, n_k = qs.shape[0], ks.shape[0]
        ks, vs = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(DIM)
        distance = torch.arange(n_q)[:, None] + (n_k - n_q) - torch.arange(n_k)[None, :]
        allowed = (distance >= 0) & (distance <= (n_k if window is None else window))
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu_q[i] : cu_q[i + 1]] = torch.einsum("hqk,khd->qhd", probs, vs)
    return out


@pytest.mark.parametrize("name", ["packed", "shared"])
def test_thd_inputs_for_transformer_engine(name):
    """What TE's THD attention receives computes the dense rule: cu_seqlens of the spans over
    the tokens (queries), and for shared prompts the gathered [prompt ; rejected] keys."""
    layout = _layouts()[name]
    params = packed_seq_params(layout, thd=True)
    assert params.qkv_format == "thd"
    assert torch.equal(params.cu_seqlens_q, layout.cu_seqlens_q)
    assert torch.equal(params.cu_seqlens_kv, layout.cu_seqlens_q)  # RoPE: keys in token order
    assert int(params.cu_seqlens_q[-1]) == layout.segment_ids.numel()
    q, k, v = _qkv(layout.segment_ids.numel())
    if layout.kv_index is None:
        cu_kv, gathered = layout.cu_seqlens_q, (k, v)
    else:
        k2, v2, kwargs = shared_prompt_thd_inputs(k, v, params)
        assert kwargs["attn_mask_type"] == "padding_causal_bottom_right"
        assert kwargs["qkv_format"] == "thd"
        assert int(kwargs["cu_seqlens_kv"][-1]) == k2.shape[0] == len(layout.kv_index)
        assert kwargs["max_seqlen_kv"] == max(torch.diff(kwargs["cu_seqlens_kv"]).tolist())
        cu_kv, gathered = kwargs["cu_seqlens_kv"], (k2, v2)
    thd = _thd_reference(q, *gathered, layout.cu_seqlens_q.tolist(), cu_kv.tolist())
    real = _real(layout)
    torch.testing.assert_close(thd[real], _dense(q, k, v, layout)[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["packed", "shared", "shared_rows"])
def test_varlen_call_computes_the_dense_rule(name, monkeypatch):
    """What the CUDA fp16 / bf16 route gives torch's varlen flash-attention (one call per
    micro-batch; it has no CPU kernel, so the call is answered here by the varlen rule written
    out from cu_seqlens, bottom-right causal): the dense rule at every real position."""
    import torch.nn.attention.varlen as varlen

    layout = _layouts()[name]
    q, k, v = _qkv(layout.segment_ids.numel())
    calls = []

    def fake(query, key, value, cu_q, cu_kv, max_q, max_kv, *, scale=None, window_size, enable_gqa):
        calls.append((window_size, enable_gqa, max_q, max_kv))
        assert key.shape[0] == int(cu_kv[-1]) and query.shape[0] == int(cu_q[-1])
        assert max_q == max(torch.diff(cu_q).tolist()) and max_kv == max(torch.diff(cu_kv).tolist())
        return _thd_reference(query, key, value, cu_q.tolist(), cu_kv.tolist())

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    out = varlen_attention(q, k, v, layout, scale=None)
    assert calls == [((-1, 0), True, layout.max_seqlen_q, layout.max_seqlen_kv)]
    real = _real(layout)
    torch.testing.assert_close(out[real], _dense(q, k, v, layout)[real], rtol=1e-5, atol=1e-6)


def test_thd_needs_one_row():
    with pytest.raises(ValueError, match="one packed row per micro-batch"):
        packed_seq_params(_layouts()["shared_rows"], thd=True)


def test_thd_rope_applies_each_tokens_own_position():
    """megatron-core's THD RoPE (the TE path) with the per-token table rotates each token by its
    own position, as the row layout does: rejected tokens continue after their prompt."""
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
        apply_rotary_pos_emb,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    class OneRank:  # a context-parallel group of one
        def size(self):
            return 1

        def rank(self):
            return 0

    batch, _ = pack_shared_prompt_pairs(PAIRS, 0, row_length=32)
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, apply_rope_fusion=False
    )
    inv_freq = 1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM)
    angles = torch.arange(32).float()[:, None] * inv_freq  # megatron-core's RoPE table layout
    table = torch.cat([angles, angles], dim=-1)
    freqs = table[batch.position_ids].transpose(0, 1).unsqueeze(2)  # [T, 1, 1, dim]
    t = torch.randn(32, HEADS, DIM)
    thd = apply_rotary_pos_emb(
        t, freqs, config, cu_seqlens=batch.packed.cu_seqlens_q, cp_group=OneRank()
    )
    rows = _apply_rotary_pos_emb_bshd(t[:, None], freqs)[:, 0]
    torch.testing.assert_close(thd, rows, rtol=0, atol=0)
    # Each rejected span's first token sits at position len(prompt): right after its prompt.
    rejected = [s for s in batch.packed.spans if len(s.keys) == 2]
    assert len(rejected) == len(PAIRS)
    for s in rejected:
        prompt = s.keys[0][1] - s.keys[0][0]
        assert batch.position_ids[0, s.q_start] == prompt


def test_auto_resolves_by_device():
    assert resolve_local_attention("auto") == ("flex" if torch.cuda.is_available() else "sdpa")
    with pytest.raises(ValueError, match="model.local_attention must be one of"):
        resolve_local_attention("flash")


# ----------------------------------------------------------------------------------------------
# every kernel inside the model, through the real trainer


def _kernel_logps(settings):
    """Forward-only per-pair log-probs of the same model and pairs for each (kernel, batch form)
    or (kernel, batch form, "sinks"): the model with attention sinks (gpt-oss's)."""
    from dpo_megatron.training.step import step_forward_backward

    pairs = random_pairs(4, 9, lambda i: (3 + 2 * i, 2 + (3 * i) % 5, 4 - i % 3))
    out = {}
    for kernel, form, *sinks in settings:
        trainer = tiny_trainer(
            pairs,
            model=dict(num_layers=2, local_attention=kernel, attention_sinks=bool(sinks)),
            seed=3,
            micro_batch_size=2,
            global_batch_size=4,
            packing=form != "padded",
            share_prompt=form == "shared",
        )
        step = step_forward_backward(
            trainer.policy,
            trainer.reference,
            trainer.next_batch(),
            trainer.loss_fn,
            forward_only=True,
        )
        out[(kernel, form, *sinks)] = {
            k: step.per_item[k].tolist() for k in ("logps/chosen", "logps/rejected")
        }
    return out


def test_every_kernel_gives_the_sdpa_log_probs():
    """Also with attention sinks, where the megatron kernel serves them (no flex)."""
    settings = [
        ("sdpa", "padded"),
        ("sdpa", "packed"),
        ("sdpa", "shared"),
        ("megatron", "padded"),
        ("megatron", "packed"),
        ("megatron", "shared"),
        ("flex", "packed"),
        ("flex", "shared"),
    ]
    # Attention sinks: the sdpa kernel's extra key against megatron-core's learnable offset.
    sinks = [("sdpa", "padded", "sinks"), ("megatron", "padded", "sinks")]
    sinks += [("megatron", "shared", "sinks"), ("sdpa", "shared", "sinks")]
    out = run_ranks(_kernel_logps, world_size=1, settings=settings + sinks)[0]
    assert out[("sdpa", "padded", "sinks")] != out[("sdpa", "padded")]  # the sinks count
    for setting, got in out.items():
        want = out[("sdpa", "padded", *setting[2:])]
        for key in want:
            a, b = torch.tensor(want[key]), torch.tensor(got[key])
            assert ((a - b).abs() <= 1e-5 * a.abs()).all(), (setting, key, a, b)


def _count_sdpa_calls(form):
    """SDPA calls of one forward-only step (policy and reference, 2 layers, 2 micro-batches)."""
    from dpo_megatron.training.step import step_forward_backward

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((attn_mask is not None, q.shape[-3] != k.shape[-3]))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    pairs = random_pairs(4, 9, lambda i: (3 + 2 * i, 2 + (3 * i) % 5, 4 - i % 3))
    trainer = tiny_trainer(
        pairs,
        model=dict(num_layers=2, local_attention="sdpa"),
        seed=3,
        micro_batch_size=2,
        global_batch_size=4,
        packing=True,
        share_prompt=form == "shared",
    )
    batch = trainer.next_batch()
    F.scaled_dot_product_attention = spy
    try:
        step_forward_backward(
            trainer.policy, trainer.reference, batch, trainer.loss_fn, forward_only=True
        )
    finally:
        F.scaled_dot_product_attention = real
    return {
        "calls": calls,
        "spans": [len(mb.packed.spans) for mb in batch.micro_batches],
        "buckets": [len(mb.packed.rows.buckets) for mb in batch.micro_batches],
    }


def test_packed_model_makes_one_sdpa_call_per_layer_micro_batch_and_bucket():
    """Through the real model: 2 models (policy, reference) x 2 layers x the micro-batches'
    buckets of rows calls for packed and shared-prompt rows alike (one per span would be
    2 x 2 x (4 + 4)), none with a mask; the tiny model has grouped-query attention (4 heads,
    2 groups)."""
    for form in ("packed", "shared"):
        out = run_ranks(_count_sdpa_calls, world_size=1, form=form)[0]
        assert min(out["spans"]) >= 4 and sum(out["buckets"]) < sum(out["spans"])
        assert len(out["calls"]) == 2 * 2 * sum(out["buckets"]), form
        assert all(gqa and not masked for masked, gqa in out["calls"]), form


def _train_flex():
    pairs = random_pairs(2, 9, lambda i: (3, 2, 2))
    trainer = tiny_trainer(
        pairs,
        model=dict(num_layers=1, local_attention="flex"),
        micro_batch_size=2,
        global_batch_size=2,
        packing=True,
    )
    try:
        trainer.train_step()
    except RuntimeError as e:
        return str(e)
    return ""


def test_flex_training_on_cpu_fails_with_the_fix():
    assert "use sdpa (or auto) there" in run_ranks(_train_flex, world_size=1)[0]


# ----------------------------------------------------------------------------------------------
# the CP seam (docs/ATTENTION.md sections 4-5): local queries, all-gathered keys, same kernel


def _cp_pieces(spans, chunks):
    """The spans seen by one CP rank holding the flat query ``chunks`` [(a, b), ...] (in local
    order): each span cut to the chunk, its keys (global) truncated after the key that the
    piece's last query sees. A stand-in for CP's own splitting function, written from the rule."""
    pieces, local = [], 0
    for a, b in chunks:
        for s in spans:
            lo, hi = max(a, s.q_start), min(b, s.q_end)
            if lo >= hi:
                continue
            drop, keys = s.q_end - hi, []  # keys past the last query's are never seen
            total = sum(e - k for k, e in s.keys)
            keep = total - drop
            for k, e in s.keys:
                take = min(e - k, keep)
                if take > 0:
                    keys.append((k, k + take))
                keep -= take
            pieces.append(AttentionSpan(local, local + hi - lo, tuple(keys), s.padding))
            local += hi - lo
    return pieces


@pytest.mark.parametrize("name", ["packed", "shared"])
def test_span_attention_on_local_queries_and_gathered_keys(name):
    """CP = 2 with megatron-core's load-balanced chunks (rank r: chunks r and 3 - r of 4): each
    rank's local queries over the full (all-gathered) keys through span_attention, unchanged,
    give the rows of the dense rule; pieces cross span boundaries (prompt / chosen / rejected)."""
    layout = _layouts()[name]
    q, k, v = _qkv(layout.segment_ids.numel())
    dense, real = _dense(q, k, v, layout), _real(layout)
    total = q.shape[0]
    assert total % 4 == 0
    step = total // 4
    bounds = [(c * step, (c + 1) * step) for c in range(4)]
    crossing = 0
    for rank in range(2):
        chunks = [bounds[rank], bounds[3 - rank]]
        local = torch.cat([torch.arange(a, b) for a, b in chunks])
        pieces = _cp_pieces(layout.spans, chunks)
        crossing += sum(len(p.keys) == 2 for p in pieces)
        out = span_attention(q[local], k, v, pieces, scale=None)
        torch.testing.assert_close(
            out[real[local]], dense[local][real[local]], rtol=1e-6, atol=1e-6
        )
    if name == "shared":
        assert crossing >= 1  # a rejected piece reads prompt keys held by another chunk


WINDOW = 2  # a query sees itself and 2 earlier keys: shorter than every sequence of PAIRS


def _dense_window(q, k, v, layout, window):
    """Reference of sliding-window attention on packed rows: the dense visibility rule and
    ``position(t) - position(s) <= window``, positions counted inside each unit along the
    query's branch (a rejected token's position continues after the prompt: HF's positions)."""
    rows, length = layout.segment_ids.shape
    visible = visible_keys(layout.segment_ids, layout.branch_ids)  # [R, 1, L, L]
    position = visible.sum(-1, keepdim=True) - 1  # [R, 1, L, 1]: keys a query sees, minus 1
    distance = position - position.transpose(-1, -2)
    mask = visible & (distance <= window)
    q, k, v = (t.reshape(rows, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows * length, HEADS, DIM)


@pytest.mark.parametrize("name", ["packed", "shared", "shared_rows"])
def test_sliding_window_span_rows_equal_the_dense_rule_forward_and_backward(name):
    """The CPU route of a windowed layer (span rows with a band mask) against the dense rule by
    positions, on packed and shared-prompt rows; the window changes the result here."""
    layout = _layouts()[name]
    real = _real(layout)
    q, k, v = _qkv(layout.segment_ids.numel(), grad=True)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    dense = _dense_window(q, k, v, layout, WINDOW)
    spans = packed_attention(q, k, v, layout, None, window=WINDOW)
    torch.testing.assert_close(spans[real], dense[real], rtol=1e-6, atol=1e-6)
    assert (spans[real] - _dense(q, k, v, layout)[real]).abs().max() > 1e-2
    grads = [
        torch.autograd.grad((out[real] * weights[real]).sum(), (q, k, v)) for out in (dense, spans)
    ]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["packed", "shared"])
def test_sliding_window_varlen_call(name, monkeypatch):
    """The CUDA fp16 / bf16 route passes the window as flash-attention's ``window_size``; the
    varlen rule with that window equals the dense rule by positions."""
    import torch.nn.attention.varlen as varlen

    layout = _layouts()[name]
    q, k, v = _qkv(layout.segment_ids.numel())
    calls = []

    def fake(query, key, value, cu_q, cu_kv, max_q, max_kv, *, scale=None, window_size, enable_gqa):
        calls.append(window_size)
        return _thd_reference(query, key, value, cu_q.tolist(), cu_kv.tolist(), window_size[0])

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    out = varlen_attention(q, k, v, layout, scale=None, window=WINDOW)
    assert calls == [(WINDOW, 0)]
    real = _real(layout)
    torch.testing.assert_close(
        out[real], _dense_window(q, k, v, layout, WINDOW)[real], rtol=1e-5, atol=1e-6
    )


def test_sliding_window_refused_by_name_where_no_kernel_serves_it():
    """flex, megatron, transformer-engine and context parallelism refuse a windowed model at
    config time, naming the field to change; sdpa builds it."""
    from dpo_megatron.models import ModelConfig
    from dpo_megatron.models.transformer_config import build_transformer_config
    from dpo_megatron.parallel import ParallelConfig

    windowed = dict(sliding_window=4, sliding_window_layers=[0])
    config = build_transformer_config(ModelConfig(**windowed), ParallelConfig())
    assert config.window_size == (3, 0) and config.window_attn_skip_freq == [1, 0]
    for kernel in ("flex", "megatron"):
        with pytest.raises(ValueError, match="set model.local_attention=sdpa"):
            build_transformer_config(
                ModelConfig(local_attention=kernel, **windowed), ParallelConfig()
            )
    with pytest.raises(ValueError, match="model.transformer_impl=local"):
        build_transformer_config(
            ModelConfig(transformer_impl="transformer_engine", **windowed), ParallelConfig()
        )
    with pytest.raises(ValueError, match="parallel.context_parallel_size=1"):
        build_transformer_config(ModelConfig(**windowed), ParallelConfig(context_parallel_size=2))
