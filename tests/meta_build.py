"""Build one rank's model chunks of any layout and size on the ``meta`` device, in one process,
with no memory: the true model code (megatron-core's GPU branch) at world sizes this machine
cannot start.

torch's fake process-group backend (``torch.testing._internal.distributed.fake_pg``: every
collective returns at once) stands in for the world; megatron-core builds its groups on it for
the chosen global rank (no gloo side groups: the fake store cannot serve them), and the engine
builds that rank's chunks as on a GPU (:mod:`tests.parallel.test_gpu_shaped_build`'s method:
the engine's device is ``cuda:0`` and every CUDA allocation lands on ``meta``). Only shapes are
real; nothing is computed.

Call :func:`rank_parameters` inside a rank process (``run_ranks(..., world_size=1)``): the
fake world replaces the rank's own, and ``cuda_on_cpu`` stays switched for the process.
"""

from __future__ import annotations

import torch


def _start_fake_world(parallel, rank: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dpo_megatron.parallel.layout import destroy_distributed

    destroy_distributed()
    world = parallel.launch_world_size()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel(),
        create_gloo_process_groups=False,
    )


def _gpu_branch_on_meta() -> None:
    from dpo_megatron.compat import cuda_on_cpu
    from dpo_megatron.parallel import device

    device.setup_device("gloo")  # megatron-core's CUDA calls answered on the host
    device._DEVICE = torch.device("cuda", 0)  # the engine now believes it is on a GPU
    cuda_on_cpu.enable("meta")  # and every CUDA allocation lands on meta
    # The all-to-all MoE dispatcher makes a side stream in its GPU branch: no tensor, no place.
    torch.cuda.Stream = lambda *args, **kwargs: object()


def rank_parameters(model, parallel, ranks: list[int], lora=None) -> dict[int, dict[str, int]]:
    """Each global rank's parameters: {rank: {name: numel}} (names as the chunks give them,
    ``chunk<i>.`` in front), built on ``meta`` with the given layout.

    Args:
        model: a ``ModelConfig`` (any size: nothing is allocated).
        parallel: the ``ParallelConfig`` of the layout; the world is its launch world size.
        ranks: the global ranks to build (megatron-core's order: TP fastest, PP slowest).
        lora: a ``LoraConfig`` to attach adapters with, or None.
    """
    from megatron.core import parallel_state

    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.parallel import set_seed

    out = {}
    for rank in ranks:
        _start_fake_world(parallel, rank)
        if not out:
            _gpu_branch_on_meta()
        set_seed(0)
        chunks = build_model_chunks(model, parallel)
        if lora is not None:
            from dpo_megatron.models.lora import attach_lora

            attach_lora(chunks, lora, model, seed=0)
        out[rank] = {
            f"chunk{i}.{name}": p.numel()
            for i, chunk in enumerate(chunks)
            for name, p in chunk.named_parameters()
        }
        del chunks
        parallel_state.destroy_model_parallel()
    return out
