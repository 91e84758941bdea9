"""The non-finite step check (``training.step.step_is_finite``): its verdicts, and its cost: no
temporary the size of a gradient buffer (it runs on every step, over every gradient)."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpo_megatron.training.step import step_is_finite

N = 10_000


class LargestOutput(TorchDispatchMode):
    """The most elements any op's output tensor had while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _chunks(*grads, expert=()):
    """Model chunks as ``step_is_finite`` reads them: DDP grad buffers of ``grad_data``, dense
    (``grads``) and expert-parallel (``expert``)."""
    return [
        SimpleNamespace(
            buffers=[SimpleNamespace(grad_data=g) for g in grads],
            expert_parallel_buffers=[SimpleNamespace(grad_data=g) for g in expert],
        )
    ]


def _grads(value=None, where=N // 2, dtype=torch.float32):
    g = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(dtype)
    if value is not None:
        g[where] = value
    return g


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_single_nonfinite_gradient_fails_the_step(value, dtype):
    assert step_is_finite(0.7, _chunks(_grads(dtype=dtype))) is True
    assert step_is_finite(0.7, _chunks(_grads(dtype=dtype), _grads(value, dtype=dtype))) is False
    assert step_is_finite(0.7, _chunks(_grads(value, where=N - 1, dtype=dtype))) is False
    # A mixture-of-experts model's expert gradients live in their own DDP buffers.
    expert = _chunks(_grads(dtype=dtype), expert=[_grads(value, dtype=dtype)])
    assert step_is_finite(0.7, expert) is False


def test_large_finite_gradients_and_a_nonfinite_loss():
    assert step_is_finite(0.7, _chunks(torch.full((N,), 1e30))) is True
    assert step_is_finite(math.nan, _chunks(_grads())) is False
    assert step_is_finite(0.7, []) is True  # a stage without trainable buffers


def test_no_temporary_the_size_of_a_gradient_buffer():
    """``isfinite`` on the buffer (and its negation) would make two [N] bool tensors."""
    grads = [_grads(), _grads()]
    with LargestOutput() as seen:
        assert step_is_finite(0.7, _chunks(*grads))
    assert 0 < seen.largest <= 2
