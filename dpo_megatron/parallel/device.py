"""The engine's device: resolved once, and the one boundary every batch crosses to reach it.

torchtitan's ``get_local_device()``: the backend decides, nothing else does.

* ``nccl``: ``cuda:LOCAL_RANK`` (the process's GPU, made current).
* ``gloo``: the CPU, with :mod:`dpo_megatron.compat.cuda_on_cpu` switched on so megatron-core's
  CUDA allocations land there too. ``parallel.backend=gloo`` forces this on a CUDA machine.
* ``auto``: NCCL when CUDA is available, gloo otherwise.

Every tensor the engine creates for a collective, a mask, a loss or a metric is created with
``device=get_device()``; host data (collated token ids, precomputed reference tables) reaches the
device through :func:`to_device` only (pinned and non-blocking on CUDA).

On a CPU machine host and device are the same, so nothing fails when a tensor is left on the
host. Tests make them differ through one seam, :func:`set_gloo_device`: ``tests/strict_device.py``
runs the engine on ``strict:0``, a stand-in accelerator whose tensors keep CPU storage but refuse
host operands as CUDA does; ``tests/host_tensors.py`` on ``cpu:0``, tagging tensors.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "nccl", "gloo")
CPU_DEVICE = torch.device("cpu")
"""The device of a gloo run, unless a test chose another with :func:`set_gloo_device`."""

_DEVICE: torch.device | None = None
_BACKEND: str | None = None
_GLOO_DEVICE: torch.device = CPU_DEVICE


def set_gloo_device(device: torch.device | str | None) -> None:
    """Make the next :func:`setup_device` for gloo compute on ``device`` (``None``: the CPU again).

    A test seam: on a CPU-only machine the engine's device is the host, so a tensor left on the
    host goes unnoticed. A test sets a device that is not the host but computes on CPU storage
    (``tests/strict_device.py``: ``strict:0``); megatron-core's CUDA requests land there too
    (:func:`dpo_megatron.compat.cuda_on_cpu.enable`). Call before :func:`setup_device`.

    Raises:
        ValueError: ``device`` is a CUDA device (use the nccl backend for that).
    """
    global _GLOO_DEVICE
    device = CPU_DEVICE if device is None else torch.device(device)
    if device.type == "cuda":
        raise ValueError(f"set_gloo_device: {device} is CUDA; use parallel.backend=nccl")
    _GLOO_DEVICE = device


CUDA_ALLOCATOR_DEFAULT = "expandable_segments:True"
"""The CUDA caching allocator's settings when the user gives none: micro-batches change shape
from step to step (padded rows to the step's longest sequence, packed rows to its tokens), and
with fixed-size segments the freed blocks of one shape fit the next one badly (fragmentation,
then out-of-memory with memory reserved but free); expandable segments grow and shrink in
place."""
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables torch reads its allocator settings from (the second is the newer name)."""


def default_cuda_allocator(environ=os.environ) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`CUDA_ALLOCATOR_DEFAULT` unless the user set it
    (or ``PYTORCH_ALLOC_CONF``), before CUDA initialises: torch reads it once, at its first
    CUDA call. The user's own value, even an empty one, is left as it is (the override).

    Returns:
        The value set, or None when nothing was set (the user's value in force, or CUDA already
        initialised, when setting it would no longer take effect).
    """
    if any(name in environ for name in ALLOCATOR_ENV) or torch.cuda.is_initialized():
        return None
    environ[ALLOCATOR_ENV[0]] = CUDA_ALLOCATOR_DEFAULT
    return CUDA_ALLOCATOR_DEFAULT


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` with CUDA, ``gloo`` without; ``nccl`` / ``gloo`` as given.

    Raises:
        ValueError: an unknown backend, or ``nccl`` on a machine without CUDA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"parallel.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend=nccl needs CUDA; this machine has none (use gloo)")
    return backend


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def setup_device(backend: str) -> torch.device:
    """Resolve the device for ``backend`` (a resolved backend: ``nccl`` or ``gloo``), make it
    current, switch on the CPU redirection when it is the CPU, and remember it. Idempotent for
    the same backend. For NCCL the CUDA allocator gets :data:`CUDA_ALLOCATOR_DEFAULT` first
    unless the user chose its settings (:func:`default_cuda_allocator`).

    Returns:
        ``cuda:LOCAL_RANK`` for NCCL, ``cpu`` for gloo (or what :func:`set_gloo_device` chose).
    """
    global _DEVICE, _BACKEND
    if backend == "nccl":
        default_cuda_allocator()  # before set_device: the first CUDA call reads the settings
        device = torch.device("cuda", _local_rank())
        torch.cuda.set_device(device)
    else:
        from dpo_megatron.compat import cuda_on_cpu, eager_fusions
        from dpo_megatron.compat.expected_warnings import filter_expected_warnings

        device = _GLOO_DEVICE
        cuda_on_cpu.enable(device)
        eager_fusions.enable()
        filter_expected_warnings(cpu=True)
    _DEVICE, _BACKEND = device, backend
    return device


def backend() -> str:
    """The communication backend the device was set up for (``nccl`` or ``gloo``; before
    set-up, what ``auto`` would choose)."""
    return _BACKEND or resolve_backend("auto")


def get_device() -> torch.device:
    """The engine's device: the one :func:`setup_device` chose, else (before set-up, e.g. in a
    unit test of a pure function) ``cuda:LOCAL_RANK`` with CUDA and ``cpu`` without."""
    if _DEVICE is not None:
        return _DEVICE
    return torch.device("cuda", _local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def is_cuda() -> bool:
    """True when the engine computes on a GPU."""
    return get_device().type == "cuda"


def is_host() -> bool:
    """True when the engine's device is the host itself (the CPU of a gloo run); False on a GPU
    and on a test's stand-in accelerator (:func:`set_gloo_device`)."""
    return get_device().type == "cpu"


def to_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the engine's device: the host-to-device boundary of every batch.

    On CUDA a host tensor is copied from pinned memory without blocking the host (the copy
    overlaps the compute queued before it); on the CPU the tensor itself is returned (through
    ``Tensor.to``, so ``tests/host_tensors.py`` sees the crossing).
    """
    device = get_device()
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def empty_cache() -> None:
    """Return cached, unused accelerator memory to the driver (no-op on the CPU)."""
    if is_cuda():
        torch.cuda.empty_cache()


def memory_stats() -> dict[str, float]:
    """This process's memory on the engine's device, GiB: ``peak`` and ``current``.

    CUDA: bytes allocated by torch's caching allocator (peak since start, and now). CPU: the
    process's resident set (peak from ``getrusage``, current from ``/proc/self/statm``), which
    holds weights, optimizer state and activations alike.
    """
    gib = float(2**30)
    if is_cuda():
        return {
            "peak": torch.cuda.max_memory_allocated() / gib,
            "current": torch.cuda.memory_allocated() / gib,
        }
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best estimate
        current = peak
    return {"peak": peak / gib, "current": current / gib}
