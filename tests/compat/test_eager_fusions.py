"""compat.eager_fusions: megatron-core's fused SwiGLU runs uncompiled on the CPU, gives the
unfused GLU's values and gradients, and keeps only its input for backward."""

import torch
import torch.nn.functional as F


def test_fused_swiglu_is_eager_exact_and_saves_only_its_input():
    from dpo_megatron.compat import eager_fusions

    assert eager_fusions.enable() is True
    from megatron.core.fusions import fused_bias_swiglu

    for name in eager_fusions.FUSED:
        fn = getattr(fused_bias_swiglu, name, None)
        assert fn is None or not hasattr(fn, "_torchdynamo_orig_callable"), name
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 16, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused = fused_bias_swiglu.bias_swiglu_impl(x, None)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()  # the input, nothing else
    a, b = torch.chunk(x, 2, -1)
    unfused = F.silu(a) * (b + 0.0)  # megatron-core's unfused GLU
    assert torch.equal(fused, unfused)
    grad = torch.randn(fused.shape, generator=g)
    (got,) = torch.autograd.grad(fused, x, grad)
    (want,) = torch.autograd.grad(unfused, x, grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_down_projection_keeps_no_copy_of_the_product_and_gradients_are_unchanged():
    """Inside recompute_marked the SwiGLU product that the next product keeps is remade in
    backward from the input the SwiGLU function keeps anyway: the same bits and gradients."""
    from dpo_megatron.compat import eager_fusions
    from dpo_megatron.utils.saved_activations import recompute_marked

    assert eager_fusions.enable() is True
    from megatron.core.fusions import fused_bias_swiglu

    g = torch.Generator().manual_seed(5)
    y = torch.randn(6, 2, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 3, generator=g, requires_grad=True)
    grads = []
    for marked in (True, False):
        with recompute_marked() if marked else torch.enable_grad():
            product = fused_bias_swiglu.bias_swiglu_impl(y, None)
            out = product.reshape(12, 8) @ w
        kept = out.grad_fn._saved_self
        assert (kept.data_ptr() != product.data_ptr()) is marked
        assert torch.equal(kept, product.reshape(12, 8))
        grads.append(torch.autograd.grad(out, (y, w), torch.ones(12, 3)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def _megatron_swiglu(y):  # megatron.core.fusions.fused_bias_swiglu.swiglu, as written
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


def _megatron_swiglu_back(g, y):  # megatron-core's swiglu_back, as written
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.cat(
        (g * torch.sigmoid(y_1) * (1 + y_1 * (1 - torch.sigmoid(y_1))) * y_2, g * F.silu(y_1)), -1
    )


def test_eager_swiglu_and_its_backward_are_megatron_cores_bit_for_bit():
    """The in-place functions that enable() puts in give megatron-core's formulas' exact bits
    (fp32 and bf16, a strided input), and the fused autograd function then uses them."""
    import inspect

    from megatron.core.fusions import fused_bias_swiglu

    from dpo_megatron.compat import eager_fusions

    assert eager_fusions.enable() is True
    assert fused_bias_swiglu.swiglu is eager_fusions.swiglu
    assert fused_bias_swiglu.swiglu_back is eager_fusions.swiglu_back
    # megatron-core's own functions are still the formulas the reference copies above hold
    kept = inspect.getsource(eager_fusions._MEGATRON_SWIGLU_BACK)
    assert "(1 + y_1 * (1 - torch.sigmoid(y_1))) * y_2, g * F.silu(y_1)" in kept
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        y = (torch.randn(37, 2, 48, generator=gen) * 4).to(dtype)
        g = torch.randn(37, 2, 24, generator=gen).to(dtype)
        for y_in in (y, y.transpose(0, 1)):  # contiguous and strided
            g_in = g if y_in is y else g.transpose(0, 1)
            assert torch.equal(eager_fusions.swiglu(y_in), _megatron_swiglu(y_in)), dtype
            got = eager_fusions.swiglu_back(g_in, y_in)
            assert got.is_contiguous() and got.dtype == dtype
            assert torch.equal(got, _megatron_swiglu_back(g_in, y_in)), dtype
    # mixed dtypes take megatron-core's function (in-place type promotion would differ)
    y, g = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen).bfloat16()
    assert torch.equal(eager_fusions.swiglu_back(g, y), _megatron_swiglu_back(g, y))
    x = torch.randn(9, 32, generator=gen, requires_grad=True)
    grad = torch.randn(9, 16, generator=gen)
    (got,) = torch.autograd.grad(fused_bias_swiglu.bias_swiglu_impl(x, None), x, grad)
    assert torch.equal(got, _megatron_swiglu_back(grad, x.detach()))


_IMPORT = """
import sys
{setup}
import megatron.core.models.gpt
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
print(int("torch._dynamo" in sys.modules), int(jit.jit_fuser is jit.noop_decorator),
      int(hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")))
"""


def _import_megatron(setup: str) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _IMPORT.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_without_cuda_megatron_core_imports_its_fusions_uncompiled():
    """megatron-core alone wraps its fusions in torch.compile at import (TorchDynamo imported);
    after ``before_megatron_import`` on this CUDA-less machine they stay plain functions."""
    import torch

    assert not torch.cuda.is_available()
    # (dynamo imported, jit_fuser is the no-op, swiglu compiled-wrapped)
    assert _import_megatron("") == ["1", "0", "1"]
    hooked = "from dpo_megatron.compat import before_megatron_import; before_megatron_import()"
    assert _import_megatron(hooked) == ["0", "1", "0"]
