"""An opt-in C allocator setting for CPU runs: freed activations go back to the OS.

On a GPU, PyTorch's caching allocator owns the device memory. On the CPU (gloo), every tensor is a
``malloc`` of the C library. glibc serves a block below its mmap threshold from the heap, and each
time it frees a mapped block it raises that threshold to the block's size (up to 32 MiB), so from
the first step on nearly every activation lives in the heap. A step frees its activations in
another order than it made them, and the next step has other sequence lengths, so the freed
blocks leave holes that later tensors do not fit: the resident set grows far past the bytes in
use. On SmolLM2-135M (30 layers, 4 pairs of up to 512 tokens, fp32) the resident set exceeded
the bytes in use by 2.7-4.3 GiB at a step's peak, about 0.5 GiB of it code and libraries
(``docs/BENCHMARKS.md``, "Where a step's peak memory goes").

With ``DPO_MEGATRON_HOST_MALLOC=release`` the engine runs with two glibc tunables
(``GLIBC_TUNABLES``, :data:`TUNABLES`):

* ``glibc.malloc.mmap_threshold=4194304``: blocks of 4 MiB and more (every activation of a real
  model) are mapped when made and unmapped when freed, at a threshold glibc no longer raises; the
  small blocks stay in the heap.
* ``glibc.malloc.hugetlb=1``: those mappings ask for transparent huge pages (``madvise``), so
  mapping a block costs one page fault per 2 MiB instead of one per 4 KiB.

The price is the kernel's work of mapping and zeroing fresh pages for every large tensor:
measured on SmolLM2-135M (30 layers, 4 pairs, shared prompts, precomputed reference), the peak RSS
fell from 8.32 to 6.51 GiB and the step time rose from 55.5 to 67.5 s (17% slower; 40% without
huge pages: 77.6 s). So it is off by default: a setting for a machine short of memory.

glibc reads ``GLIBC_TUNABLES`` once, when a process starts, so :func:`restart_with_malloc_tunables`
re-executes the process (same PID, arguments and descriptors) with them before anything is
imported; the training entry point calls it first. Launchers need not know about it. Nothing
changes unless ``DPO_MEGATRON_HOST_MALLOC=release``, when the C library is not glibc, or when
``GLIBC_TUNABLES`` already sets a ``glibc.malloc`` tunable (the user's own choice). The loss is
the same either way: only where the bytes live changes.

This module imports nothing beyond the standard library: it runs before torch is imported.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

TUNABLES = ("glibc.malloc.mmap_threshold=4194304", "glibc.malloc.hugetlb=1")
"""The engine's glibc malloc tunables (module docstring)."""

SWITCH = "DPO_MEGATRON_HOST_MALLOC"
"""Environment variable: ``release`` turns the tunables on; unset (or ``system``): glibc's own
malloc behaviour."""


def malloc_env(environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """``environ`` with :data:`TUNABLES` added to ``GLIBC_TUNABLES``, or None when nothing is
    to change: ``DPO_MEGATRON_HOST_MALLOC`` is not ``release``, not glibc, or ``GLIBC_TUNABLES``
    already sets a ``glibc.malloc`` tunable (the engine's own, or the user's)."""
    if environ.get(SWITCH, "") != "release" or platform.libc_ver()[0] != "glibc":
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
    env = malloc_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def describe(environ: Mapping[str, str] = os.environ) -> str:
    """One phrase for the start-up line: the malloc tunables in force, or glibc's default."""
    active = [t for t in environ.get("GLIBC_TUNABLES", "").split(":")
              if t.startswith("glibc.malloc.")]
    return "host malloc: " + (", ".join(t[len("glibc.malloc."):] for t in active)
                              if active else "the C library's default")
