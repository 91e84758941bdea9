"""TP-reduced per-token log-probs equal log_softmax + gather on the full vocabulary, from logits
and from the hidden states through the chunked LM head (``vocab_parallel_linear_logps``)."""

import pytest
import torch

from dpo_megatron.models.logprobs import (
    vocab_parallel_linear_logps,
    vocab_parallel_log_sum_p2,
    vocab_parallel_token_logps,
)
from tests.multirank import run_ranks


def _full_logits(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 12, generator=g, dtype=dtype) * 4
    labels = torch.randint(0, 12, (2, 5), generator=g)
    return logits, labels


def _reference(logits, labels):
    logits = logits.detach().clone().requires_grad_(True)
    logps = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    weights = torch.arange(1, labels.numel() + 1, dtype=logps.dtype).view(labels.shape)
    (logps * weights).sum().backward()
    return logps.detach(), logits.grad


def test_single_rank_matches_log_softmax_and_grad():
    logits, labels = _full_logits()
    expected, expected_grad = _reference(logits, labels)
    x = logits.clone().requires_grad_(True)
    out = vocab_parallel_token_logps(x, labels, group=None, chunk_tokens=3)
    weights = torch.arange(1, labels.numel() + 1, dtype=out.dtype).view(labels.shape)
    (out * weights).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_gradcheck_float64():
    logits, labels = _full_logits(torch.float64)
    x = logits[:, :3].clone().requires_grad_(True)

    def fn(z):
        return vocab_parallel_token_logps(z, labels[:, :3], group=None, chunk_tokens=2)

    assert torch.autograd.gradcheck(fn, (x,))


def test_bf16_logits_give_fp32_logps():
    logits, labels = _full_logits()
    out = vocab_parallel_token_logps(logits.bfloat16(), labels, group=None)
    assert out.dtype == torch.float32
    expected, _ = _reference(logits.bfloat16(), labels)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_gradient_is_the_formula_in_fp32_and_rounded_in_bf16():
    """Backward (each chunk written in place into the logits' gradient for fp32 logits, made
    then stored for bf16) gives g * (onehot - exp(z - lse)) for every chunk: 3 chunks of 4
    rows and one of 1 here."""
    logits, labels = _full_logits()
    flat, targets = logits.reshape(-1, 12), labels.reshape(-1)
    grad = torch.linspace(-2.0, 3.0, targets.numel())
    lse = torch.logsumexp(flat, -1)
    want = -(flat - lse[:, None]).exp() * grad[:, None]
    want.scatter_add_(-1, targets[:, None], grad[:, None])
    for dtype in (torch.float32, torch.bfloat16):
        x = flat.to(dtype).requires_grad_(True)
        out = vocab_parallel_token_logps(x, targets, group=None, chunk_tokens=4)
        (got,) = torch.autograd.grad(out, x, grad)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        else:
            z = x.detach().float()
            lse16 = torch.logsumexp(z, -1)
            ref = -(z - lse16[:, None]).exp() * grad[:, None]
            ref.scatter_add_(-1, targets[:, None], grad[:, None])
            torch.testing.assert_close(got.float(), ref.bfloat16().float(), rtol=0, atol=1e-2)
            assert got.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consumed_logits_take_their_gradient_with_the_same_values(dtype):
    """``consume_logits``: backward writes the gradient into the logits' own memory (no second
    vocabulary-wide tensor) and gives the same values as the default path, chunk by chunk."""
    logits, labels = _full_logits()
    flat, targets = logits.reshape(-1, 12).to(dtype), labels.reshape(-1)
    grad = torch.linspace(-2.0, 3.0, targets.numel())
    kept = flat.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(
        vocab_parallel_token_logps(kept, targets, group=None, chunk_tokens=4), kept, grad
    )
    leaf = flat.clone().requires_grad_(True)
    made = leaf * 1  # a non-leaf, as the output layer's logits are
    out = vocab_parallel_token_logps(made, targets, group=None, chunk_tokens=4, consume_logits=True)
    (got,) = torch.autograd.grad(out, made, grad, retain_graph=True)
    assert got.data_ptr() == made.data_ptr()  # the logits' memory holds their gradient
    assert torch.equal(got, want)
    assert torch.equal(kept.detach(), flat)  # not handed over: left as they were


def test_default_chunks_stay_below_glibcs_mmap_ceiling():
    """The default chunk of logits is at most 16 MiB in fp32 (heap memory, reused chunk after
    chunk on the CPU) at SmolLM2's vocabulary, and at least one row at any vocabulary."""
    from dpo_megatron.models.logprobs import LOGITS_CHUNK_ELEMENTS, _chunk_rows

    assert _chunk_rows(None, 49152) * 49152 * 4 <= 16 * 2**20
    assert _chunk_rows(None, 49152) == 85
    assert _chunk_rows(None, 10 * LOGITS_CHUNK_ELEMENTS) == 1
    assert _chunk_rows(7, 49152) == 7


def test_log_sum_p2_single_rank():
    logits, _ = _full_logits()
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(
        vocab_parallel_log_sum_p2(logits, chunk_tokens=4),
        (p**2).sum(-1).log(),
        rtol=1e-6,
        atol=1e-6,
    )


def _tp_shard_logps(tp):
    import torch.distributed as dist

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp))
    logits, labels = _full_logits()
    shard = logits.shape[-1] // tp
    rank = dist.get_rank()
    x = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    out = vocab_parallel_token_logps(x, labels, chunk_tokens=4)
    weights = torch.arange(1, labels.numel() + 1, dtype=out.dtype).view(labels.shape)
    (out * weights).sum().backward()
    return out.detach(), x.grad, vocab_parallel_log_sum_p2(x)


@pytest.mark.slow
def test_tp2_and_tp3_equal_full_vocabulary():
    logits, labels = _full_logits()
    expected, expected_grad = _reference(logits, labels)
    p = torch.softmax(logits, -1)
    for tp in (2, 3):
        results = run_ranks(_tp_shard_logps, world_size=tp, tp=tp)
        shard = logits.shape[-1] // tp
        for rank, (out, grad, lsp2) in enumerate(results):
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                grad, expected_grad[..., rank * shard : (rank + 1) * shard], rtol=1e-6, atol=1e-6
            )
            torch.testing.assert_close(lsp2, (p**2).sum(-1).log(), rtol=1e-6, atol=1e-6)


def test_minus_inf_padding_columns_are_excluded_exactly():
    """Padding ids carry -inf logits (models.gpt); targets outside this shard must stay finite."""
    logits, labels = _full_logits()
    padded = torch.cat([logits, torch.full((2, 5, 4), float("-inf"))], dim=-1)
    x = padded.clone().requires_grad_(True)
    out = vocab_parallel_token_logps(x, labels, group=None)
    out.sum().backward()
    expected, expected_grad = _reference(logits, labels)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(x.grad).all() and (x.grad[..., 12:] == 0).all()


def _tp2_with_padding():
    import torch.distributed as dist

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=2))
    logits, labels = _full_logits()  # 12 real ids; padded to 16: rank 1 holds ids 8..11 + 4 pads
    padded = torch.cat([logits, torch.full((2, 5, 4), float("-inf"))], dim=-1)
    rank = dist.get_rank()
    x = padded[..., rank * 8 : (rank + 1) * 8].clone().requires_grad_(True)
    out = vocab_parallel_token_logps(x, labels)
    out.sum().backward()
    return out.detach(), x.grad


@pytest.mark.slow
def test_tp2_padding_shard_matches_unpadded_vocabulary():
    logits, labels = _full_logits()
    x = logits.clone().requires_grad_(True)
    expected = torch.log_softmax(x, -1).gather(-1, labels[..., None]).squeeze(-1)
    expected.sum().backward()
    results = run_ranks(_tp2_with_padding, world_size=2)
    for out, _ in results:
        torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)
    grad = torch.cat([g for _, g in results], -1)
    torch.testing.assert_close(grad[..., :12], x.grad, rtol=1e-6, atol=1e-6)
    assert (grad[..., 12:] == 0).all()


# --- the chunked LM head: hidden states and the output weight in, log-probs out -------------


def _head(dtype=torch.float32, n=11, h=6, vocab=12):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(vocab, h, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, labels


def _head_reference(hidden, weight, labels, valid=None):
    """Plain autograd: full logits, log_softmax over the real columns, weighted sum backward."""
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = (x @ w.T)[:, :valid]
    logps = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    p = torch.softmax(logits.detach(), -1)
    (logps * torch.arange(1.0, len(labels) + 1, dtype=logps.dtype)).sum().backward()
    return logps.detach(), (p**2).sum(-1).log(), x.grad, w.grad


def _head_run(hidden, weight, labels, **kwargs):
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = vocab_parallel_linear_logps(x, w, labels, **kwargs)
    (
        out.token_logps * torch.arange(1.0, len(labels) + 1, dtype=out.token_logps.dtype)
    ).sum().backward()
    return out, x.grad, w.grad


@pytest.mark.parametrize("chunk_elements", [12, 5 * 12, 10**6])  # 1 row, 5 rows, one chunk
def test_linear_head_equals_full_logits_and_autograd(chunk_elements):
    hidden, weight, labels = _head()
    logps, lsp2, grad_x, grad_w = _head_reference(hidden, weight, labels)
    out, gx, gw = _head_run(hidden, weight, labels, log_sum_p2=True, chunk_elements=chunk_elements)
    assert out.token_logps.dtype == torch.float32 and not out.log_sum_p2.requires_grad
    torch.testing.assert_close(out.token_logps, logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.log_sum_p2, lsp2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, grad_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, grad_w, rtol=1e-5, atol=1e-6)
    # and the same as the logits-based path on the same logits
    torch.testing.assert_close(
        out.token_logps, vocab_parallel_token_logps(hidden @ weight.T, labels), rtol=1e-6, atol=1e-6
    )


def test_linear_head_gradcheck_float64():
    hidden, weight, labels = _head(torch.float64, n=5, h=3, vocab=7)
    x, w = hidden.requires_grad_(True), weight.requires_grad_(True)

    def fn(a, b):
        return vocab_parallel_linear_logps(
            a, b, labels, valid_columns=6, chunk_elements=14
        ).token_logps

    assert torch.autograd.gradcheck(fn, (x, w))


def test_linear_head_padding_columns_get_probability_zero():
    hidden, weight, labels = _head()
    padded = torch.cat([weight, torch.zeros(4, weight.shape[1])])  # 4 padding ids, zero rows
    logps, lsp2, grad_x, grad_w = _head_reference(hidden, weight, labels)
    out, gx, gw = _head_run(
        hidden, padded, labels, valid_columns=12, log_sum_p2=True, chunk_elements=32
    )
    torch.testing.assert_close(out.token_logps, logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.log_sum_p2, lsp2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, grad_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw[:12], grad_w, rtol=1e-5, atol=1e-6)
    assert (gw[12:] == 0).all()


def test_linear_head_frozen_weight_gets_no_gradient():
    """LoRA freezes the output layer: only the hidden states get a gradient."""
    hidden, weight, labels = _head()
    _, _, grad_x, _ = _head_reference(hidden, weight, labels)
    x = hidden.clone().requires_grad_(True)
    out = vocab_parallel_linear_logps(x, weight, labels, chunk_elements=36)
    (out.token_logps * torch.arange(1.0, 12)).sum().backward()
    torch.testing.assert_close(x.grad, grad_x, rtol=1e-5, atol=1e-6)


def test_linear_head_saves_no_vocabulary_wide_tensor():
    """The memory contract: backward keeps the hidden states and per-token values only."""
    hidden, weight, labels = _head(n=64, h=8, vocab=40)
    x, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        vocab_parallel_linear_logps(x, w, labels, chunk_elements=400).token_logps.sum()
    assert {tuple(t.shape) for t in saved} == {(64, 8), (40, 8), (64,)}


def test_linear_head_rejects_mismatched_shapes():
    hidden, weight, labels = _head()
    with pytest.raises(ValueError, match=r"hidden \[n, h\] and weight"):
        vocab_parallel_linear_logps(hidden, weight[:, :4], labels)
    with pytest.raises(ValueError, match=r"labels \[11\]"):
        vocab_parallel_linear_logps(hidden, weight, labels[:5])


def _tp_linear_head(tp):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp))
    hidden, weight, labels = _head()
    shard = weight.shape[0] // tp
    rank = dist.get_rank()
    x = hidden.clone().requires_grad_(True)
    w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    out = vocab_parallel_linear_logps(
        copy_to_tensor_model_parallel_region(x),
        w,
        labels,
        log_sum_p2=True,
        chunk_elements=2 * shard,
    )
    (out.token_logps * torch.arange(1.0, 12)).sum().backward()
    return out.token_logps.detach(), out.log_sum_p2, x.grad, w.grad


@pytest.mark.slow
def test_linear_head_tp2_and_tp3_equal_full_vocabulary():
    hidden, weight, labels = _head()
    logps, lsp2, grad_x, grad_w = _head_reference(hidden, weight, labels)
    for tp in (2, 3):
        shard = weight.shape[0] // tp
        for rank, (out, p2, gx, gw) in enumerate(run_ranks(_tp_linear_head, world_size=tp, tp=tp)):
            torch.testing.assert_close(out, logps, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(p2, lsp2, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(gx, grad_x, rtol=1e-5, atol=1e-6)  # all-reduced over TP
            torch.testing.assert_close(
                gw, grad_w[rank * shard : (rank + 1) * shard], rtol=1e-5, atol=1e-6
            )
