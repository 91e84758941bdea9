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
