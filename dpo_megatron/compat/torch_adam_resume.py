"""Load distributed-optimizer state into torch's Adam (megatron-core 0.16, no apex / TE).

Without apex or transformer-engine megatron-core's optimizer is torch's Adam(W). Resuming its
``fully_reshardable`` state then hits three faults of megatron-core 0.16:

1. torch's Adam creates its state (``step``, moments) at the first step, but the distributed
   optimizer reads ``step`` from that state when it builds the state dict to load into.
   :func:`materialize_optimizer_state` runs megatron-core's own dummy step first (zero
   gradients); the load then overwrites whatever it set.
2. The distributed optimizer restores ``step`` from the parameter groups, then copies every
   per-parameter key from the checkpoint, whose per-parameter tensors skip ``step``
   (``KeyError: 'step'``). During the load the already-restored ``step`` is passed along.
3. It gives every parameter the *same* ``step`` tensor; torch's Adam increments each parameter's
   step in place, so the shared counter would advance once per parameter per step and the bias
   correction of the resumed run would be wrong. After the load each parameter gets its own copy.

Switched on only for megatron-core 0.16 and only for optimizers whose inner optimizer is torch's
(apex's and TE's fused Adam keep ``step`` per group and never reach this path).
"""

from __future__ import annotations

import contextlib

import torch

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="torch_adam_resume",
        why="megatron-core 0.16's distributed optimizer cannot load fully_reshardable state into "
        "torch's Adam: no state before the first step, KeyError 'step', one shared step tensor",
        versions={"megatron-core": "==0.16.*"},
        switched_on="loading a training checkpoint into megatron-core's optimizer on torch's Adam",
    )
)


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def needed(optimizer) -> bool:
    """True when this megatron-core optimizer wraps torch's Adam on the versions it fixes."""
    if not PATCH.applies_to_installed():
        return False
    return any(
        isinstance(getattr(opt, "optimizer", None), torch.optim.Adam)
        for opt in _inner_optimizers(optimizer)
    )


def materialize_optimizer_state(optimizer) -> None:
    """Create the optimizer state of a fresh optimizer so it can receive a checkpoint (fault 1)."""
    if not needed(optimizer):
        return
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if (
            inner is not None
            and not inner.state
            and hasattr(opt, "_init_optimizer_states_with_dummy_values")
        ):
            opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def keep_torch_adam_step(optimizer):
    """Around ``optimizer.load_state_dict(...)``: faults 2 and 3 (see the module docstring)."""
    if not needed(optimizer):
        yield
        return
    patched = []
    for opt in _inner_optimizers(optimizer):
        if not hasattr(opt, "_set_main_param_and_optimizer_states"):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _original=original):
            current = _opt._get_main_param_and_optimizer_states(model_param)
            if "step" in current and "step" not in tensors:
                tensors = {**tensors, "step": current["step"]}
            _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for param_state in inner.state.values() if inner is not None else ():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()
