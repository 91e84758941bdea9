"""compat.checkpoint_without_output_without_te: megatron-core 0.16's output-discarding checkpoint
raises NameError without transformer-engine; with the patch it recomputes the discarded output
and gives autograd's gradients."""

import importlib.util

import pytest

from tests.compat import assert_name_error_then_patched

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="the fault only exists without transformer-engine",
)

SCRIPT = """
import torch
from dpo_megatron.compat import cuda_on_cpu
cuda_on_cpu.enable()  # megatron-core saves the CUDA RNG state: on the CPU, as every CPU run
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
def norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
w = torch.randn(8, 8, requires_grad=True)
x = torch.randn(4, 8, requires_grad=True)
try:
    CheckpointWithoutOutput().checkpoint(norm, x)
    print("no fault")
except NameError as e:
    print("NameError", e)
from dpo_megatron.compat import checkpoint_without_output_without_te as patch
assert patch.enable() and patch.enable()
ckpt = CheckpointWithoutOutput()
y = ckpt.checkpoint(norm, x)
out = y @ w
ckpt.discard_output_and_register_recompute(out)
assert y.untyped_storage().size() == 0  # discarded until backward recomputes it
out.square().sum().backward()
xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
(norm(xr) @ wr).square().sum().backward()
assert torch.allclose(x.grad, xr.grad) and torch.allclose(w.grad, wr.grad)
print("patched ok")
"""


def test_checkpoint_without_output_fails_without_the_patch_and_works_with_it():
    assert_name_error_then_patched(SCRIPT, "FP8GlobalStateManager")
