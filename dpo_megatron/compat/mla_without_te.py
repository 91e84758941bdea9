"""megatron-core's multi-latent attention without transformer-engine.

``megatron.core.transformer.multi_latent_attention`` (0.16) imports ``TELinear`` from
``megatron.core.extensions.transformer_engine`` in a ``try`` block and sets ``HAVE_TE = True``
when that import succeeds. Without transformer-engine the import still succeeds (the extension
module stands in ``MagicMock`` objects for TE's classes), so ``MultiLatentAttention.__init__``
evaluates ``isinstance(self.linear_proj, TELinear)`` with a mock as the class: ``TypeError:
isinstance() arg 2 must be a type`` for every MLA layer built on the local spec. :func:`enable`
sets the module's ``HAVE_TE`` to False when transformer-engine is not importable, which skips
that (fp8-only) branch, as the module intends.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when it builds a multi-latent
attention model and transformer-engine is not importable.
"""

from __future__ import annotations

import importlib.util

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="mla_without_te",
        why="megatron-core 0.16's multi-latent attention believes transformer-engine is present "
        "when only its mock stand-ins imported: TypeError in isinstance() on every MLA layer",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a multi-latent attention model is built and transformer-engine is not "
        "importable",
    )
)

__all__ = ["PATCH", "enable"]


def enable() -> bool:
    """Set ``multi_latent_attention.HAVE_TE = False`` when transformer-engine is not importable.

    Idempotent. Returns True when the module's flag is (now) False.
    """
    if not PATCH.applies_to_installed():
        return False
    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
    return True
