"""Run megatron-core's real layers, schedules, DDP and distributed optimizer with the CPU as device.

megatron-core 0.16 assumes a GPU in a handful of places (``shared/MEGATRON_CPU_NOTES.md``):

* buffers are allocated with ``device=torch.cuda.current_device()`` or the literal
  ``device='cuda'``;
* ``Tensor.cuda()`` / ``Tensor.to('cuda')`` move tensors;
* the distributed optimizer and grad clipping accept only ``torch.cuda.*Tensor`` type strings;
* the model-parallel RNG tracker saves and restores the CUDA generator state;
* ``torch.cuda.synchronize`` / ``nvtx`` markers are called unconditionally.

:func:`enable` redirects all of these to the CPU: a :class:`torch.overrides.TorchFunctionMode`
rewrites CUDA ``device`` arguments of every torch call and answers ``Tensor.type()`` with the CUDA
name megatron-core expects, and a few ``torch.cuda`` / megatron attributes are replaced by CPU
equivalents.

Switched on by the device owner (:mod:`dpo_megatron.parallel.device`) when the engine's device is
the CPU: a machine without CUDA, or ``parallel.backend=gloo`` forced on a CUDA machine (then the
whole run, megatron-core's buffers included, stays on the host). Never on a CUDA device.

The device CUDA requests land on is the engine's gloo device: the CPU, or in tests a stand-in
accelerator (``tests/strict_device.py``'s ``strict:0``, whose tensors keep CPU storage but refuse
host operands as CUDA does) chosen through :func:`dpo_megatron.parallel.device.set_gloo_device`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="cuda_on_cpu",
        why="megatron-core allocates on torch.cuda.current_device() / 'cuda', checks "
        "torch.cuda.*Tensor type names and forks the CUDA RNG; without CUDA these fail",
        versions={"megatron-core": ">=0.16.0,<0.17", "torch": ">=2.6"},
        switched_on="when the engine's device is the CPU (gloo backend)",
        off_on_other_versions=False,  # a CPU run cannot do without it
    )
)

__all__ = ["PATCH", "enable", "is_enabled", "suspended"]

_ENABLED = False
_MODE: _CudaToCpuMode | None = None
_TARGET = torch.device("cpu")
"""Where CUDA requests land (:func:`enable`'s ``device``)."""

# Tensor.type() strings megatron-core compares against, keyed by the CPU dtype.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def is_cuda_device(device: Any) -> bool:
    """True for every spelling of a CUDA device: 'cuda', 'cuda:1', torch.device('cuda'), or an
    int."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # torch's convention: a bare int names a CUDA device
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_if_cuda(value: Any) -> Any:
    return _TARGET if is_cuda_device(value) else value


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call, and fakes ``Tensor.type()`` names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False): to the target (a no-op on the CPU).
            return args[0].to(_TARGET)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu_if_cuda(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The distributed optimizer and clip_grads dispatch on 'torch.cuda.FloatTensor' etc.
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        return func(*args, **kwargs)


def _patch_rng() -> None:
    """Make the CUDA RNG API and megatron's tracker helpers act on the CPU default generator.

    The model-parallel RNG tracker (``tensor_parallel.random``) forks a named generator state
    around dropout and initialisation; on the CPU the default CPU generator plays that role.
    """
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.random.manual_seed = torch.cuda.manual_seed


def _patch_cuda_module() -> None:
    """Device queries and synchronisation points that have a trivial CPU meaning."""
    # A string, not an int: megatron passes it straight to ``device=`` and that must also work
    # where the mode is not on the stack (the autograd engine runs backward() of custom
    # Functions, e.g. the TP linear layers', outside the thread's torch-function modes).
    torch.cuda.current_device = lambda: str(_TARGET)
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.nvtx.range_push = lambda msg: None
    torch.cuda.nvtx.range_pop = lambda: None


def enable(device: torch.device | str = "cpu") -> bool:
    """Redirect megatron-core's CUDA calls to ``device`` (the CPU, or a test's stand-in for an
    accelerator that computes on CPU storage) for the rest of the process.

    Idempotent; a second call only changes the target. Must run before megatron-core builds
    models, buffers or optimizers. The caller (the device owner) calls it only when the engine's
    device is not CUDA. The RNG helpers act on the CPU generator whatever the target.

    Returns:
        True (the redirection is active).

    Raises:
        ValueError: ``device`` is a CUDA device.
    """
    global _ENABLED, _MODE, _TARGET
    device = torch.device(device)
    if device.type == "cuda":
        raise ValueError(f"cuda_on_cpu.enable: the target must not be CUDA (got {device})")
    _TARGET = device
    if _ENABLED:
        return True
    _patch_cuda_module()
    _patch_rng()
    # The mode stays pushed for the life of the process: megatron-core allocates buffers lazily
    # (pipeline receive buffers, grad buffers, optimizer state) long after set-up.
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ENABLED = True
    return True


def is_enabled() -> bool:
    """Whether :func:`enable` has activated the CPU redirection in this process."""
    return _ENABLED


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within the block, torch calls bypass the redirection mode (a no-op when it is not on or
    another mode is above it).

    While the mode is pushed, every torch call and every tensor attribute read (``x.shape``,
    ``x.dtype``) goes through its Python ``__torch_function__``: about 140 of them in a
    transformer layer's forward, 0.6 ms of a 12-layer SmolLM2-shaped decode step per layer
    (43 against 51 ms, one thread). For a block that makes no CUDA request of its own: the
    model's forward in generation, where megatron-core asks ``torch.cuda.current_device()``
    (answered on the CPU without the mode) and nothing else.
    """
    if not _ENABLED or torch.overrides._get_current_function_mode() is not _MODE:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield
