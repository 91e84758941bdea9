"""ORPO's log(1 - exp(x)) stays finite (value and gradient) at average log-probs near and at 0."""

import decimal
import math

import pytest
import torch

from dpo_megatron.losses import LOSSES
from dpo_megatron.losses.terms import log1mexp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("average", [-1e-8, 0.0])
@pytest.mark.parametrize("side", ["chosen", "rejected", "both"])
def test_orpo_finite_near_zero(dtype, average, side):
    tokens = torch.tensor([4.0, 4.0], dtype=dtype)
    chosen = torch.tensor([4 * average, -2.0], dtype=dtype)
    rejected = torch.tensor([-3.0, 4 * average], dtype=dtype)
    if side == "chosen":
        rejected = torch.tensor([-3.0, -2.5], dtype=dtype)
    elif side == "rejected":
        chosen = torch.tensor([-2.0, -1.5], dtype=dtype)
    chosen.requires_grad_()
    rejected.requires_grad_()
    losses, metrics = LOSSES["orpo"].fn(
        chosen, rejected, None, None, chosen_tokens=tokens, rejected_tokens=tokens
    )
    assert losses.dtype == torch.float32
    assert torch.isfinite(losses).all(), losses
    assert all(torch.isfinite(value).all() for value in metrics.values())
    losses.sum().backward()
    assert torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()


def log1mexp_100_digits(x: float) -> float:
    with decimal.localcontext() as context:
        context.prec = 100
        return float((1 - decimal.Decimal(x).exp()).ln())


def test_log1mexp_matches_a_100_digit_reference():
    values = [-1e-6, -1e-3, -0.5, -math.log(2.0), -1.0, -20.0, -100.0]
    x = torch.tensor(values, dtype=torch.float64)
    expected = torch.tensor([log1mexp_100_digits(v) for v in values], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), expected, rtol=1e-9, atol=0)
    torch.testing.assert_close(log1mexp(x.float()), expected.float(), rtol=1e-6, atol=1e-40)


def test_log1mexp_gradient_is_finite_on_both_branches():
    x = torch.tensor([0.0, -1e-8, -0.69, -0.7, -50.0], requires_grad=True)
    log1mexp(x).sum().backward()
    assert torch.isfinite(x.grad).all()
