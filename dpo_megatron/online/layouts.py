"""Phases of one world on different layouts: megatron-core's model-parallel state torn down and
built again for the next phase's ``ParallelConfig``; the default process group (the world) and
the device stay."""

from __future__ import annotations

import gc

from dpo_megatron.compat.model_parallel_teardown import destroy_model_parallel
from dpo_megatron.parallel import ParallelConfig

_KEY_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)
_current: list = [None]


def _key(parallel: ParallelConfig) -> tuple:
    return tuple(getattr(parallel, name) for name in _KEY_FIELDS)


def sampling_layout(cfg) -> ParallelConfig:
    """The policy's layout while it samples: ``online.sampling.parallel`` over ``parallel.*``
    (``SamplingLayoutConfig.resolve``)."""
    return cfg.online.sampling.parallel.resolve(cfg.parallel)


def name_sampling_keys(cfg, message: str) -> str:
    """``message``, an error about the sampling layout in ``parallel.*``'s words, with each size
    that ``online.sampling.parallel`` sets named by its own key (a size it leaves at 0 is
    ``parallel.*``'s, and keeps that name)."""
    own = cfg.online.sampling.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(own, name):
            message = message.replace(f"parallel.{name}", f"online.sampling.parallel.{name}")
    return message


def use_layout(parallel: ParallelConfig) -> bool:
    """Make ``parallel`` the layout of megatron-core's groups (collective). Nothing happens when
    it is the layout already built by this module; otherwise the groups are destroyed and built
    again (``parallel.initialize_distributed``, which also starts the world the first time).
    Returns whether groups were rebuilt.

    Raises:
        ValueError: the layout does not fit the world size.
    """
    from megatron.core import parallel_state

    from dpo_megatron.parallel import initialize_distributed

    if parallel_state.model_parallel_is_initialized():
        if _current[0] == _key(parallel):
            return False
        destroy_model_parallel()
    initialize_distributed(parallel)
    _current[0] = _key(parallel)
    return True


def forget_layout() -> None:
    """Tear the groups down (the Trainer builds its own from ``parallel.*``): the next
    :func:`use_layout` builds afresh."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    _current[0] = None


def free_models() -> None:
    """Return a phase's freed models to the system before the next phase builds its own (call
    after the last reference to them is dropped)."""
    from dpo_megatron.parallel.device import empty_cache

    gc.collect()
    empty_cache()
