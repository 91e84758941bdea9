"""compat.moe_alltoall_on_cpu: the all-to-all MoE dispatcher's CUDA-stream calls, split sizes
and uneven expert-TP collectives on the CPU / gloo. (The dispatcher itself, end to end, is
checked against transformers and against the all-gather dispatcher at EP 2 and TP 2 x EP 2 in
``tests/models/test_new_architectures.py``.)"""

import numpy as np
import pytest
import torch

from tests.multirank import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_host_stream_stands_in_for_cuda_streams():
    from dpo_megatron.compat import moe_alltoall_on_cpu

    assert moe_alltoall_on_cpu.enable() and moe_alltoall_on_cpu.enable()  # idempotent
    side = torch.cuda.Stream()
    assert torch.cuda.current_stream() == side  # one stream: no side-stream bookkeeping
    assert (torch.cuda.Stream | None) is not None  # still a type (libraries annotate with it)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        event = side.record_event()
    event.synchronize()
    splits = moe_alltoall_on_cpu.host_copy(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    assert moe_alltoall_on_cpu.host_copy(torch.tensor(5)).item() == 5


def _uneven_collectives():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    from dpo_megatron.compat import moe_alltoall_on_cpu
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    initialize_distributed(ParallelConfig(tensor_model_parallel_size=2))
    group, rank = ps.get_tensor_model_parallel_group(), dist.get_rank()
    splits = [3, 1]
    piece = torch.full((splits[rank], 2), float(rank + 1))
    try:
        mappings._gather_along_first_dim(piece, group, splits)
        unpatched = "no error"
    except RuntimeError as exc:  # gloo: "invalid tensor size"
        unpatched = str(exc)
    moe_alltoall_on_cpu.enable()
    gathered = mappings.gather_from_sequence_parallel_region(
        piece, group=group, output_split_sizes=splits
    )
    full = torch.arange(8.0).view(4, 2) * (rank + 1)
    scattered = mappings.reduce_scatter_to_sequence_parallel_region(
        full, group=group, input_split_sizes=splits
    )
    return unpatched, gathered, scattered


@pytest.mark.slow
def test_uneven_gather_and_reduce_scatter_on_gloo():
    results = run_ranks(_uneven_collectives, world_size=2)
    want = torch.tensor([[1.0, 1.0]] * 3 + [[2.0, 2.0]])
    summed = torch.arange(8.0).view(4, 2) * 3  # rank 0's x1 + rank 1's x2
    for rank, (unpatched, gathered, scattered) in enumerate(results):
        assert "invalid tensor size" in unpatched  # the fault the patch works around
        assert torch.equal(gathered, want)
        assert torch.equal(scattered, summed[:3] if rank == 0 else summed[3:])
