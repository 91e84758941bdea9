"""TP-reduced per-token log-probs equal log_softmax + gather on the full vocabulary."""

import pytest
import torch

from dpo_megatron.training.logprobs import vocab_parallel_log_sum_p2, vocab_parallel_token_logps
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


def test_log_sum_p2_single_rank():
    logits, _ = _full_logits()
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(vocab_parallel_log_sum_p2(logits, chunk_tokens=4),
                               (p ** 2).sum(-1).log(), rtol=1e-6, atol=1e-6)


def _tp_shard_logps(tp):
    import torch.distributed as dist

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp))
    logits, labels = _full_logits()
    shard = logits.shape[-1] // tp
    rank = dist.get_rank()
    x = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
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
                grad, expected_grad[..., rank * shard:(rank + 1) * shard], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(lsp2, (p ** 2).sum(-1).log(), rtol=1e-6, atol=1e-6)


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
    x = padded[..., rank * 8:(rank + 1) * 8].clone().requires_grad_(True)
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
