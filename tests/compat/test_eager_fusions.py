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
