"""megatron-core's fused activation kernels, run eagerly on the CPU.

megatron-core wraps its fusions (``megatron.core.fusions.fused_bias_swiglu``: ``swiglu`` and its
backward) in ``torch.compile`` (``megatron.core.jit.jit_fuser``). On the CPU that compiles C++
with inductor at the first call of every new shape: 116 s for one SwiGLU on the 2-core build
machine. The fused *autograd function* is what this engine wants (``SwiGLUFunction`` saves only
its input and recomputes SiLU in backward, where the unfused GLU keeps the SiLU output, a copy of
the linear half and the product: 3 extra [tokens, ffn] tensors per layer), not the compiled
kernel; so on the CPU the module's functions are replaced by the plain Python functions that
``torch.compile`` wrapped (the same ops, run eagerly).

Wrapping costs too: each ``torch.compile(fn)`` at megatron-core's import (a dozen modules
decorate functions with ``jit_fuser``) imports TorchDynamo and inductor, 1.5 s of the 4.3 s that
a rank's megatron-core imports take on the CPU, in every process of every launch. Where torch sees
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

from dpo_megatron.compat.registry import Patch, register

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


def enable() -> bool:
    """Unwrap the compiled fusions (idempotent); returns True when the patch is applied."""
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.fusions import fused_bias_swiglu

    for name in FUSED:
        fn = getattr(fused_bias_swiglu, name, None)
        original = getattr(fn, "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(fused_bias_swiglu, name, original)
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
