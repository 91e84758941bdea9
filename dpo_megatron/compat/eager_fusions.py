"""megatron-core's fused activation kernels, run eagerly on the CPU.

megatron-core wraps its fusions (``megatron.core.fusions.fused_bias_swiglu``: ``swiglu`` and its
backward) in ``torch.compile`` (``megatron.core.jit.jit_fuser``). On the CPU that compiles C++
with inductor at the first call of every new shape, a long compile on a CPU. The fused
*autograd function* is what this engine wants (``SwiGLUFunction`` saves only
its input and recomputes SiLU in backward, where the unfused GLU keeps the SiLU output, a copy of
the linear half and the product: 3 extra [tokens, ffn] tensors per layer), not the compiled
kernel; so on the CPU the module's functions are replaced by the plain Python functions that
``torch.compile`` wrapped (the same ops, run eagerly).

Run eagerly, those functions are written for a compiler: ``swiglu_back`` is a dozen
full-size element-wise passes, each into a new [tokens, ffn] tensor, and a ``torch.cat``. So
:func:`enable` also puts in :func:`swiglu` and :func:`swiglu_back`: the same operations on the
same operands in the same order (bit-identical results, tested), written for eager execution,
into one output buffer with one temporary (the gain, measured: ``docs/BENCHMARKS.md``).
``bias_swiglu``, ``weighted_swiglu`` and their backwards look these names up at call time and use
them too.

The product that ``SwiGLUFunction`` returns is the down projection's input, which that linear keeps
for its weight gradient (half the feed-forward width per token and layer), while the function
keeps its own input ``y`` for its backward. :func:`enable` marks the product recomputable from
``y`` (``dpo_megatron.utils.saved_activations``: :func:`swiglu` again in backward, two
element-wise passes, instead of the kept tensor). Not where ``y`` itself is not kept (megatron-
core's FP8 input store or activation offloading).

Wrapping costs too: each ``torch.compile(fn)`` at megatron-core's import (a dozen modules
decorate functions with ``jit_fuser``) imports TorchDynamo and inductor, a large share of a
rank's megatron-core import on the CPU (``docs/BENCHMARKS.md``), in every process of every
launch. Where torch sees
no CUDA device (nothing would be compiled for it), :func:`compile_only_on_cuda` throws
megatron-core's own switch, ``megatron.core.jit.disable_jit_fuser``, the moment
``megatron.core.jit`` has run, before any module decorates with it: the functions stay plain.

Switched on by the device owner when the engine's device is the CPU (:func:`enable`), and by every
entry point before megatron-core's import (:func:`compile_only_on_cuda`, through
:func:`dpo_megatron.compat.before_megatron_import`); on megatron-core 0.16 only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING

from dpo_megatron.compat.registry import Patch, register

if TYPE_CHECKING:
    import torch

PATCH = register(
    Patch(
        name="eager_fusions",
        why="megatron-core's fused SwiGLU is torch.compile'd: minutes of C++ compilation per shape "
        "on the CPU",
        versions={"megatron-core": "==0.16.*"},
        switched_on="by the device owner when the engine's device is the CPU",
    )
)

FUSED = (
    "swiglu",
    "bias_swiglu",
    "weighted_swiglu",
    "swiglu_back",
    "bias_swiglu_back",
    "weighted_swiglu_back",
)
"""The ``torch.compile``'d functions of ``megatron.core.fusions.fused_bias_swiglu``."""


# torch is imported inside the functions: this module is imported before megatron-core by
# config-only entry points (the launcher's pre-check), which never import torch.


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SiLU(y_1) * y_2 for y = [y_1 ; y_2] split in halves on the last dimension (Shazeer 2020,
    arXiv:2002.05202, eq. 6): [..., 2f] -> [..., f]. megatron-core's ``swiglu`` with the product
    written into the SiLU output (one [..., f] tensor made instead of two)."""
    import torch
    import torch.nn.functional as F

    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1).mul_(y_2)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d(sum g * swiglu(y)) / dy: [..., f] and [..., 2f] -> [..., 2f], in megatron-core's formula

        [ g * s * (1 + y_1 * (1 - s)) * y_2 ; g * SiLU(y_1) ],   s = sigmoid(y_1)

    evaluated operation for operation in its order (so bit-identical), in place: the two
    halves are written into one output, s is the only temporary. Operands of two dtypes (type
    promotion would differ in place) take megatron-core's own function."""
    import torch

    if g.dtype != y.dtype:
        return _MEGATRON_SWIGLU_BACK(g, y)
    y_1, y_2 = torch.chunk(y, 2, -1)
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    out_1, out_2 = torch.chunk(out, 2, -1)
    s = torch.sigmoid(y_1)
    torch.mul(g, s, out=out_1)  # g * s
    s.neg_().add_(1).mul_(y_1).add_(1)  # 1 + y_1 * (1 - s): 1 - s is -s + 1 exactly
    out_1.mul_(s).mul_(y_2)
    torch.ops.aten.silu.out(y_1, out=out_2)
    out_2.mul_(g)  # g * SiLU(y_1): a product is the same either way round
    return out


_MEGATRON_SWIGLU_BACK = None
"""megatron-core's (uncompiled) ``swiglu_back``, kept for mixed-dtype operands."""

_MEGATRON_SWIGLU_FORWARD = None
"""megatron-core's ``SwiGLUFunction.forward``, which :func:`_swiglu_forward` calls."""


def _swiglu_forward(ctx, input, fp8_input_store, cpu_offload_input):
    """megatron-core's ``SwiGLUFunction.forward``, its product marked recomputable from the
    ``input`` it keeps (module docstring)."""
    import functools

    # here, not at the top: this module is imported by entry points that never import torch
    from dpo_megatron.utils.saved_activations import recomputable

    out = _MEGATRON_SWIGLU_FORWARD(ctx, input, fp8_input_store, cpu_offload_input)
    if not fp8_input_store and not cpu_offload_input:
        recomputable(out, functools.partial(swiglu, input))
    return out


def enable() -> bool:
    """Unwrap the compiled fusions and put in the eager :func:`swiglu` / :func:`swiglu_back`
    (idempotent); returns True when the patch is applied."""
    global _MEGATRON_SWIGLU_BACK
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.fusions import fused_bias_swiglu

    for name in FUSED:
        fn = getattr(fused_bias_swiglu, name, None)
        original = getattr(fn, "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(fused_bias_swiglu, name, original)
    if fused_bias_swiglu.swiglu_back is not swiglu_back:
        _MEGATRON_SWIGLU_BACK = fused_bias_swiglu.swiglu_back
    fused_bias_swiglu.swiglu = swiglu
    fused_bias_swiglu.swiglu_back = swiglu_back
    function = fused_bias_swiglu.SwiGLUFunction
    if function.forward is not _swiglu_forward:
        global _MEGATRON_SWIGLU_FORWARD
        _MEGATRON_SWIGLU_FORWARD = function.forward
        function.forward = staticmethod(_swiglu_forward)
    return True


JIT_MODULE = "megatron.core.jit"
"""megatron-core's module that picks ``jit_fuser`` (``torch.compile`` on torch >= 2.2)."""


class _JitFuserOffWithoutCuda(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the normal path finder does, and has its loader call the
    module's ``disable_jit_fuser()`` right after running it when torch sees no CUDA device."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module  # this spec's own loader (one per found file)

        def run_then_switch_off(module):
            run(module)
            import torch

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = run_then_switch_off
        return spec


def compile_only_on_cuda() -> bool:
    """Before megatron-core's first import: on a machine without CUDA its ``jit_fuser``
    decorations become no-ops (no TorchDynamo / inductor import, plain functions). Returns
    whether the hook is in place (False once ``megatron.core.jit`` is imported: :func:`enable`
    unwraps the SwiGLU functions then, as before; or on other megatron-core versions).
    Idempotent."""
    if not PATCH.applies_to_installed() or JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(f, _JitFuserOffWithoutCuda) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFuserOffWithoutCuda())
    return True
