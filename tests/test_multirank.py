"""The multi-rank test helper: results by rank, and a failing rank ends the run at once."""

import os
import time

import pytest

from tests.multirank import run_ranks


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
