"""The C allocator on CPU runs: free heap pages go back to the OS, by default or by setting.

On a GPU, PyTorch's caching allocator owns the device memory. On the CPU (gloo), every tensor is a
``malloc`` of the C library. glibc serves a block below its mmap threshold from the heap, and each
time it frees a mapped block it raises that threshold to the block's size (up to 32 MiB), so from
the first step on nearly every activation lives in the heap. A forward pass frees its transients
(norm and RoPE intermediates, projections' outputs) between the activations it keeps, and glibc
does not fit the next layer's tensors into all of those holes: the freed pages stay resident.
On SmolLM2-135M (30 layers, 4 pairs of up to 512 tokens, fp32) the heap held 2.9-3.1 GiB of free
blocks at a step's peak beside 5.8 GiB in use: the resident set was 10.9 GiB for 7.9 GiB of
tensors and libraries (``docs/BENCHMARKS.md``, "The C allocator's free pages").

``DPO_MEGATRON_HOST_MALLOC`` (:data:`SWITCH`) chooses what the engine does about it:

* unset or ``trim`` (the default): after each transformer layer's forward in the policy,
  :func:`release_free_heap` calls glibc's ``malloc_trim(0)``, which returns every whole page of
  the heap's free blocks to the OS (``madvise(MADV_DONTNEED)``) and keeps the blocks themselves,
  so the resident set follows the bytes in use (7.8 GiB instead of 10.9 above). A call walks
  glibc's free lists: about 25 ms per layer there, under 1% of the step; the pages a later tensor
  reuses are faulted in again.
* ``release``: glibc's tunables :data:`TUNABLES` (``GLIBC_TUNABLES``):
  ``glibc.malloc.mmap_threshold=4194304`` maps every block of 4 MiB and more when made and unmaps
  it when freed, and ``glibc.malloc.hugetlb=1`` asks for transparent huge pages for those
  mappings. The resident set is about the same as with ``trim``, but mapping and zeroing fresh
  pages for every large tensor made a step 17% slower (55.5 -> 67.5 s on
  ``engine+shared+precomputed``).
* ``system``: glibc as it comes, nothing trimmed.

glibc reads ``GLIBC_TUNABLES`` once, when a process starts, so :func:`restart_with_malloc_tunables`
re-executes the process (same PID, arguments and descriptors) with them before anything is
imported; the training entry point calls it first. Launchers need not know about it. The
tunables are not added when the C library is not glibc, or when ``GLIBC_TUNABLES`` already sets a
``glibc.malloc`` tunable (the user's own choice). Trimming needs glibc and a CPU device. The loss is
the same in every mode: only where the bytes live changes.

This module imports nothing beyond the standard library at import time: it runs before torch is
imported.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from typing import Mapping, Optional, Sequence

TUNABLES = ("glibc.malloc.mmap_threshold=4194304", "glibc.malloc.hugetlb=1")
"""The engine's glibc malloc tunables (module docstring)."""

SWITCH = "DPO_MEGATRON_HOST_MALLOC"
"""Environment variable: ``trim`` (the default when unset), ``release`` or ``system`` (module
docstring)."""

MODES = ("trim", "release", "system")


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """The host malloc mode :data:`SWITCH` selects: ``trim`` when unset.

    Raises:
        ValueError: a value not in :data:`MODES`.
    """
    value = environ.get(SWITCH, "") or "trim"
    if value not in MODES:
        raise ValueError(f"{SWITCH}={value!r}: expected one of {', '.join(MODES)} "
                         "(unset means trim)")
    return value


def _glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def malloc_env(environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """``environ`` with :data:`TUNABLES` added to ``GLIBC_TUNABLES``, or None when nothing is
    to change: ``DPO_MEGATRON_HOST_MALLOC`` is not ``release``, not glibc, or ``GLIBC_TUNABLES``
    already sets a ``glibc.malloc`` tunable (the engine's own, or the user's).

    Raises:
        ValueError: an unknown ``DPO_MEGATRON_HOST_MALLOC`` (:func:`mode`).
    """
    if mode(environ) != "release" or not _glibc():
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in current:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = ":".join(([current] if current else []) + list(TUNABLES))
    return env


def restart_with_malloc_tunables() -> None:
    """Re-execute this process with :func:`malloc_env` when it changes anything (else return).

    Call it before torch is imported (the allocator is set up at start-up; what the process made
    before the call is discarded by the exec). The process keeps its PID, its arguments
    (``sys.orig_argv``) and its open descriptors, so torchrun, srun and pipes see no difference.
    """
    try:
        env = malloc_env(os.environ)
    except ValueError as exc:  # before torch: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def release_free_heap() -> None:
    """Return the whole pages of the C heap's free blocks to the OS (glibc ``malloc_trim(0)``);
    nothing elsewhere. Blocks in use are untouched: no tensor moves or changes."""
    if _glibc():
        _libc().malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL("libc.so.6")


def trim_after_each_layer(model_chunks: Sequence, device) -> int:
    """In ``trim`` mode on a CPU device with glibc, make every transformer layer of
    ``model_chunks`` call :func:`release_free_heap` after its forward (a forward hook, so also in
    recomputed forwards); elsewhere nothing.

    Args:
        model_chunks: the policy's model chunks (``torch.nn.Module``, DDP-wrapped or not).
        device: the engine's ``torch.device``: on a GPU the activations are not the C heap's.

    Returns:
        the number of layers hooked (0 when nothing was done).

    Raises:
        ValueError: an unknown ``DPO_MEGATRON_HOST_MALLOC`` (:func:`mode`).
    """
    if mode() != "trim" or device.type != "cpu" or not _glibc():
        return 0
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for chunk in model_chunks for m in chunk.modules()
              if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.register_forward_hook(lambda module, args, output: release_free_heap())
    return len(layers)


def describe(environ: Mapping[str, str] = os.environ, trimming: bool = False) -> str:
    """One phrase for the start-up line: the malloc tunables in force, or glibc's default, and
    whether free heap pages are returned after each layer (``trimming``)."""
    active = [t for t in environ.get("GLIBC_TUNABLES", "").split(":")
              if t.startswith("glibc.malloc.")]
    text = "host malloc: " + (", ".join(t[len("glibc.malloc."):] for t in active)
                              if active else "the C library's default")
    return text + (", free heap pages returned after each layer" if trimming else "")
