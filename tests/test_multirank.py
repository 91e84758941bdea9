"""The multi-rank test helper: results by rank, and a failing rank ends the run at once."""

import os
import time

import pytest

from tests.multirank import run_in_turn, run_ranks


def _rank_or_fail(fail_rank):
    import torch.distributed as dist

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig())
    if int(os.environ["RANK"]) == fail_rank:
        raise ValueError("boom on purpose")
    dist.barrier()  # the healthy rank blocks here when the other one failed
    return int(os.environ["RANK"]), dist.get_world_size()


def test_results_come_back_by_rank():
    assert run_ranks(_rank_or_fail, world_size=2, fail_rank=-1) == [(0, 2), (1, 2)]


def test_a_failing_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom on purpose") as e:
        run_ranks(_rank_or_fail, world_size=2, fail_rank=1)
    assert "rank 1" in str(e.value)
    assert time.monotonic() - start < 60  # not the 30-minute collective timeout


def _threads_after_a_layout(tensor_model_parallel_size: int) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for _ in range(3):  # as a case that tries several layouts itself
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
        dist.all_reduce(torch.ones(1), group=ps.get_tensor_model_parallel_group())
    return len(os.listdir("/proc/self/task"))


def test_layouts_in_turn_do_not_pile_up_process_groups():
    """Each case's megatron-core groups are shut down before the next: without that every
    layout left ~50 gloo threads a rank behind (1500 a rank in the architecture parity world)."""
    cases = {f"layout{i}": {"tensor_model_parallel_size": 1 + i % 2} for i in range(6)}
    threads = run_ranks(run_in_turn, world_size=2, each=_threads_after_a_layout, cases=cases)
    for by_case in threads:
        counts = list(by_case.values())
        assert max(counts[2:]) <= counts[1], counts
