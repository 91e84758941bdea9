"""The parallel layout: one dataclass, and the function that builds its process groups.

World size = tensor_model_parallel_size x pipeline_model_parallel_size x data-parallel size.
The data-parallel size is whatever is left of the world size (``data_parallel_size``, when set,
only tells launchers how many ranks to start and is checked against the world size).
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from dpo_megatron.parallel import cpu_compat


@dataclass
class ParallelConfig:
    """How the model and the batch are split across ranks (megatron-core's terms)."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each weight matrix (and the vocabulary) of a layer."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the stack of layers into consecutive stages."""
    data_parallel_size: Optional[int] = None
    """Model replicas. None: world size / (TP x PP). Launchers use it to choose the world size;
    under torchrun it must agree with the world size."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved 1F1B schedule (None: not interleaved)."""
    sequence_parallel: bool = False
    """Split activations outside attention/MLP along the sequence across the TP group
    (Korthikanti et al. 2022). Needs tensor_model_parallel_size > 1."""
    backend: str = "auto"
    """'auto' (NCCL with CUDA, gloo without), 'nccl' or 'gloo'."""
    distributed_timeout_minutes: int = 30
    """Timeout for collectives before the job fails instead of hanging."""

    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: TP x PP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def validate(self, world_size: int) -> None:
        """Reject layouts that cannot be built on ``world_size`` ranks.

        Raises:
            ValueError: naming the conflicting fields and what to do.
        """
        mp = self.model_parallel_size()
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("parallel.tensor_model_parallel_size and "
                             "parallel.pipeline_model_parallel_size must be >= 1")
        if world_size % mp != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size"
                f" ({self.tensor_model_parallel_size}) x parallel.pipeline_model_parallel_size"
                f" ({self.pipeline_model_parallel_size}) = {mp}: launch a multiple of {mp} ranks")
        if self.data_parallel_size is not None and self.data_parallel_size * mp != world_size:
            raise ValueError(
                f"parallel.data_parallel_size={self.data_parallel_size} x TP x PP = "
                f"{self.data_parallel_size * mp} but the job has {world_size} ranks: launch "
                f"{self.data_parallel_size * mp} ranks or drop parallel.data_parallel_size")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel=true needs "
                             "parallel.tensor_model_parallel_size > 1")
        if self.virtual_pipeline_model_parallel_size is not None and (
                self.pipeline_model_parallel_size < 2):
            raise ValueError("parallel.virtual_pipeline_model_parallel_size needs "
                             "parallel.pipeline_model_parallel_size >= 2")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be auto, nccl or gloo, got {self.backend!r}")


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def initialize_distributed(cfg: ParallelConfig) -> None:
    """Start torch.distributed from torchrun's environment and build megatron-core's groups.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun / SLURM launcher set
    them; a single process without them runs as world size 1). On a machine without CUDA, enables
    :mod:`dpo_megatron.parallel.cpu_compat` first.

    Raises:
        ValueError: if the layout does not fit the world size.
    """
    cpu_compat.enable()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    cfg.validate(world_size)

    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        backend = _resolve_backend(cfg.backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(minutes=cfg.distributed_timeout_minutes),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
            distributed_timeout_minutes=cfg.distributed_timeout_minutes,
        )


def destroy_distributed() -> None:
    """Tear down megatron-core's groups and the default process group (tests, clean exits)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
