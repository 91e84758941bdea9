"""compat.moe_router_without_te: megatron-core 0.16's router gating raises NameError without
transformer-engine; with the patch it computes ``input @ weight.T`` (and its gradients)."""

import importlib.util

import pytest

from tests.compat import assert_name_error_then_patched

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="the fault only exists without transformer-engine",
)

SCRIPT = """
import torch
from megatron.core.transformer.moe.moe_utils import router_gating_linear
x = torch.randn(5, 8, requires_grad=True); w = torch.randn(4, 8, requires_grad=True)
try:
    router_gating_linear(x, w, None, torch.float32)
    print("no fault")
except NameError as e:
    print("NameError", e)
from dpo_megatron.compat import moe_router_without_te
assert moe_router_without_te.enable() and moe_router_without_te.enable()
out = router_gating_linear(x, w, None, torch.float32)
out.square().sum().backward()
xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
(xr @ wr.t()).square().sum().backward()
assert torch.allclose(out, xr @ wr.t()) and torch.allclose(x.grad, xr.grad)
assert torch.allclose(w.grad, wr.grad)
print("patched ok")
"""


def test_router_gating_fails_without_the_patch_and_works_with_it():
    assert_name_error_then_patched(SCRIPT, "te_general_gemm")
