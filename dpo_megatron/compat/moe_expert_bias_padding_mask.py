"""megatron-core's expert-bias token count with a padding mask.

``TopKRouter._apply_expert_bias`` (megatron-core 0.16) counts the tokens routed to each expert
for the expert-bias update: with a padding mask it computes ``routing_map & ~padding_mask``,
a [tokens, experts] map against the [tokens] mask flattened just before, which fails to
broadcast (``RuntimeError`` at the first training forward of a model with
``moe_router_enable_expert_bias`` that passes a padding mask: DeepSeek-V3 here, whose rows are
padded). It is also ``torch.compile``'d (``jit_fuser``): a C++ build per shape on the CPU.
:func:`enable` replaces it with the same count with the mask as a column, run eagerly.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when it builds a
mixture-of-experts model with an expert score bias (``model.moe_router_expert_bias``).
"""

from __future__ import annotations

import torch

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="moe_expert_bias_padding_mask",
        why="megatron-core 0.16's expert-bias token count masks a [tokens, experts] routing map "
        "with a [tokens] padding mask: a broadcast error in every padded training forward",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a mixture-of-experts model with an expert score bias is built",
    )
)

__all__ = ["PATCH", "enable"]


def _apply_expert_bias(
    self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> None:
    """Add this forward's tokens per expert ([tokens, experts] map; [tokens] mask, True =
    padding, not counted) to ``local_tokens_per_expert``; only with gradients (not in
    evaluation or in a recompute without them), as megatron-core's."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def enable() -> bool:
    """Replace ``TopKRouter._apply_expert_bias`` (idempotent); True when the patch applies."""
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _apply_expert_bias
    return True
