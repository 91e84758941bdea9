"""Build the process groups of a :class:`~dpo_megatron.parallel.config.ParallelConfig` layout,
seed the ranks, and tear the groups down again."""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch

from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.parallel.device import resolve_backend, setup_device


def initialize_distributed(cfg: ParallelConfig) -> None:
    """Start torch.distributed from torchrun's environment and build megatron-core's groups.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun / SLURM launcher set
    them; a single process without them runs as world size 1). The backend fixes the device
    first (:func:`dpo_megatron.parallel.device.setup_device`: cuda:LOCAL_RANK for NCCL, the CPU
    with megatron-core's CUDA calls redirected for gloo).

    Raises:
        ValueError: if the layout does not fit the world size, or NCCL is asked for without CUDA.
    """
    backend = resolve_backend(cfg.backend)
    setup_device(backend)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    cfg.validate(world_size)

    from megatron.core import parallel_state

    from dpo_megatron.compat import gloo_shared_device

    if not torch.distributed.is_initialized():
        gloo_shared_device.install()  # every gloo group of this process on one device
        torch.distributed.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(minutes=cfg.distributed_timeout_minutes),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            context_parallel_size=cfg.context_parallel_size,
            virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel(),
            distributed_timeout_minutes=cfg.distributed_timeout_minutes,
        )


def destroy_distributed() -> None:
    """Tear down megatron-core's groups and the default process group (tests, clean exits)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def is_stage_writer() -> bool:
    """Whether this rank writes its pipeline stage's share of a file every rank computes: TP rank
    0 and DP rank 0 (the other TP ranks hold other shards of the same stage, which rank 0 of the
    stage gathers first where it needs them; the other DP ranks hold copies)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def set_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and megatron-core's model-parallel RNG tracker.

    megatron-core offsets the tracker's seed by the TP rank (so dropout differs across TP shards
    where it must) and by the PP rank; call after :func:`initialize_distributed`.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rendezvous for local jobs)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
