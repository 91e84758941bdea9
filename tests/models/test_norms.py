"""RMSNorm: HF Llama's forward bit for bit, the analytic backward, and what it keeps for it."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from dpo_megatron.models.norms import RMSNorm


def _norm(dtype, hidden=16):
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, params_dtype=dtype
    )
    norm = RMSNorm(config, hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, hidden))
    return norm


def _composite(x, weight, eps=1e-5):
    """LlamaRMSNorm's forward (transformers), the ops autograd differentiates one by one."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_llama_rmsnorm_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = _norm(dtype)
    hf = LlamaRMSNorm(16, eps=1e-5).to(dtype)
    hf.weight.data.copy_(norm.weight.data)
    x = (torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    assert torch.equal(norm(x), hf(x))


def test_backward_matches_autograd_of_the_composite_ops():
    norm = _norm(torch.float32)
    x = (torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_(True)
    grad = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2))
    gx, gw = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    w = norm.weight.detach().clone().requires_grad_(True)
    rx, rw = torch.autograd.grad(_composite(x, w), (x, w), grad)
    torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-6, atol=1e-6)


def test_gradcheck_float64():
    norm = _norm(torch.float64, hidden=6)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: norm(a), (x,))
    assert torch.autograd.gradcheck(
        lambda w: torch.nn.utils.stateless.functional_call(norm, {"weight": w}, (x.detach(),)),
        (norm.weight.detach().clone().requires_grad_(),),
    )


def test_backward_keeps_only_the_input_and_the_per_token_rstd():
    """Autograd over the composite ops also keeps the normalised input ([..., h] again)."""
    norm = _norm(torch.float32)
    x = torch.randn(8, 2, 16, requires_grad=True)
    for forward, expected in (
        (norm, [(8, 2, 16), (16,), (8, 2, 1)]),
        (lambda a: _composite(a, norm.weight), [(8, 2, 16), (8, 2, 16), (16,), (8, 2, 1)]),
    ):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            forward(x)
        big = {t.untyped_storage().data_ptr(): tuple(t.shape) for t in saved}
        assert sorted(big.values()) == sorted(expected)


def test_a_following_product_keeps_no_copy_of_the_output_and_gradients_are_unchanged():
    """Inside recompute_marked the output that a product keeps for its weight gradient is
    remade in backward from the norm's own x and rstd (not kept): the same bits, the same
    gradients as with the output kept."""
    from dpo_megatron.utils.saved_activations import recompute_marked

    norm = _norm(torch.float32)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 16, generator=g) * 2).requires_grad_(True)
    w = torch.randn(16, 4, generator=g, requires_grad=True)
    grads = []
    for marked in (True, False):
        with recompute_marked() if marked else torch.enable_grad():
            normed = norm(x)
            out = normed @ w
        kept = out.grad_fn._saved_self
        assert (kept.data_ptr() != normed.data_ptr()) is marked and torch.equal(kept, normed)
        grads.append(torch.autograd.grad(out, (x, w, norm.weight), torch.ones(6, 4)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


HEADS, HEAD_DIM = 4, 3


def _projection_case():
    """Queries [s=5, b=2, heads, head_dim], a weight over the whole projection, output weights."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    out_grad = torch.randn(5, 2, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    return x, weight, out_grad


def _projection_norm_on_ranks():
    """This TP rank's output, input gradient and weight gradient of ProjectionRMSNorm (TP 2)."""
    from dpo_megatron.models.norms import ProjectionRMSNorm
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=2))
    rank = torch.distributed.get_rank()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=2,
        params_dtype=torch.float64,
    )
    norm = ProjectionRMSNorm(config, HEAD_DIM, eps=1e-6)
    x, weight, out_grad = _projection_case()
    half = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
    with torch.no_grad():
        norm.weight.copy_(weight.view(HEADS, HEAD_DIM)[half].reshape(-1))
    local = x[:, :, half].clone().requires_grad_(True)
    out = norm(local)
    (out * out_grad[:, :, half]).sum().backward()
    return out.detach(), local.grad, norm.weight.grad


@pytest.mark.slow
def test_projection_norm_at_tp2_equals_olmo_norm_over_all_heads_forward_and_backward():
    """OLMo's q/k norm (one RMSNorm over every head) split over 2 TP ranks: each rank's output
    and both gradients equal the single-process norm's slices (fp64). Without the backward
    all-reduce the input gradients would miss the other rank's share."""
    from tests.multirank import run_ranks

    x, weight, out_grad = _projection_case()
    x = x.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    flat = x.reshape(5, 2, -1)
    want = (w * (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6))).view(x.shape)
    (want * out_grad).sum().backward()
    for rank, (out, x_grad, w_grad) in enumerate(run_ranks(_projection_norm_on_ranks, 2)):
        half = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
        torch.testing.assert_close(out, want.detach()[:, :, half], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x_grad, x.grad[:, :, half], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            w_grad, w.grad.view(HEADS, HEAD_DIM)[half].reshape(-1), rtol=1e-10, atol=1e-12
        )
