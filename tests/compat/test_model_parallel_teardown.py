"""compat.model_parallel_teardown: switching layouts in one world does not pile up process
groups (megatron-core 0.16's own teardown leaves every group's gloo threads alive)."""

from __future__ import annotations

import os

import pytest

from tests.multirank import run_ranks


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _switch_layouts(patched: bool) -> list[int]:
    """Threads of this rank after each of 4 layout switches (TP 2, PP 2, TP 2, PP 2)."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.compat.model_parallel_teardown import PATCH, destroy_model_parallel
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    assert PATCH.applies_to_installed()
    # The test ranks' own harness (tests/multirank.py) wraps megatron-core's teardown so that
    # it also destroys groups; put megatron-core's own back to see what it leaves.
    wrapped = ps.destroy_model_parallel
    cells = [c.cell_contents for c in (wrapped.__closure__ or ())]
    ps.destroy_model_parallel = next(
        (c for c in cells if getattr(c, "__name__", "") == "destroy_model_parallel"), wrapped
    )
    counts = []
    for i in range(4):
        tp, pp = (2, 1) if i % 2 == 0 else (1, 2)
        if ps.model_parallel_is_initialized():
            destroy_model_parallel() if patched else ps.destroy_model_parallel()
        initialize_distributed(
            ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        )
        counts.append(_threads())
    destroy_model_parallel()
    ps.destroy_model_parallel = wrapped
    return counts


@pytest.mark.slow
def test_switching_layouts_keeps_the_thread_count():
    leaked = run_ranks(_switch_layouts, world_size=2, patched=False)[0]
    kept = run_ranks(_switch_layouts, world_size=2, patched=True)[0]
    assert leaked[3] > leaked[1], leaked  # megatron-core 0.16 alone: the groups stay alive
    assert kept[3] == kept[1], kept  # destroyed at each switch: nothing accumulates
