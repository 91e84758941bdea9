"""megatron-core's fused activation kernels, run eagerly on the CPU.

megatron-core wraps its fusions (``megatron.core.fusions.fused_bias_swiglu``: ``swiglu`` and its
backward) in ``torch.compile`` (``megatron.core.jit.jit_fuser``). On the CPU that compiles C++
with inductor at the first call of every new shape: 116 s for one SwiGLU on the 2-core build
machine. The fused *autograd function* is what this engine wants (``SwiGLUFunction`` saves only
its input and recomputes SiLU in backward, where the unfused GLU keeps the SiLU output, a copy of
the linear half and the product: 3 extra [tokens, ffn] tensors per layer), not the compiled
kernel; so on the CPU the module's functions are replaced by the plain Python functions that
``torch.compile`` wrapped (the same ops, run eagerly).

Switched on by the device owner when the engine's device is the CPU, on megatron-core 0.16 only.
"""

from __future__ import annotations

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
