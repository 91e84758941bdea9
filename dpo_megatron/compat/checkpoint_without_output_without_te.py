"""megatron-core's output-discarding checkpoint without transformer-engine.

``megatron.core.tensor_parallel.random.CheckpointWithoutOutput`` (0.16) sets
``self.fp8 = fp8 is not None``, which is True for its default ``fp8=False``, and then reads
transformer-engine's ``FP8GlobalStateManager``, a name defined only when transformer-engine
imports. So without it (every CPU run, GPU machines without it) selective recompute of
``'layernorm'`` (the only user here: ``TransformerLayer``'s norms) raises ``NameError: name
'FP8GlobalStateManager' is not defined`` on the first forward. Without transformer-engine there is
no FP8 to save or restore; :func:`enable` makes the object say so (``fp8 = False``), which selects
its plain recompute path.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when a model with selective
recompute is built and transformer-engine is not importable.
"""

from __future__ import annotations

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="checkpoint_without_output_without_te",
        why="megatron-core 0.16's CheckpointWithoutOutput takes fp8=False for FP8 (fp8 is not "
        "None) "
        "and reads transformer-engine's FP8GlobalStateManager: NameError on selective recompute "
        "of 'layernorm' without transformer-engine",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a model with recompute_granularity=selective is built and "
        "transformer-engine is not importable",
    )
)

__all__ = ["PATCH", "enable"]


def enable() -> bool:
    """Make every ``CheckpointWithoutOutput`` made from now on run without FP8 state.

    Idempotent. Returns True when the patch is (now) in place.
    """
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.tensor_parallel import random

    cls = random.CheckpointWithoutOutput
    if getattr(cls, "_dpo_megatron_no_fp8", False):
        return True
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False  # no transformer-engine: no FP8 recipe to carry into the recompute

    cls.__init__ = __init__
    cls._dpo_megatron_no_fp8 = True
    return True
