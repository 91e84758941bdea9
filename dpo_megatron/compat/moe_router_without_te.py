"""megatron-core's MoE router gating without transformer-engine.

``megatron.core.transformer.moe.moe_utils`` (0.16) imports ``te_general_gemm`` inside its
``try: import transformer_engine`` block and then tests ``if te_general_gemm is not None`` in
``RouterGatingLinearFunction`` unconditionally, so without transformer-engine (every CPU run, and
GPU machines without it) the first router forward raises ``NameError: name 'te_general_gemm' is
not defined``. Its other transformer-engine names are guarded by ``HAVE_TE``. :func:`enable`
defines the missing name as None, which selects the function's own ``torch.mm`` path.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when it builds a
mixture-of-experts model and transformer-engine is not importable.
"""

from __future__ import annotations

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="moe_router_without_te",
        why="megatron-core 0.16's router gating reads te_general_gemm, which is only defined when "
        "transformer-engine imports: NameError on every MoE forward without it",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a mixture-of-experts model is built and transformer-engine is not "
        "importable",
    )
)

__all__ = ["PATCH", "enable"]


def enable() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` when transformer-engine did not import.

    Idempotent. Returns True when the name is (now) defined.
    """
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return True
