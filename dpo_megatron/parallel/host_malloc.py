"""How the engine's processes use the C allocator: freed activations go back to the OS.

On a GPU, PyTorch's caching allocator owns the device memory. On the CPU (gloo), every tensor is a
``malloc`` of the C library. glibc serves a block below its mmap threshold from the heap, and each
time it frees a mapped block it raises that threshold to the block's size (up to 32 MiB), so from
the first step on nearly every activation lives in the heap. A step frees its activations in
another order than it made them, and the next step has other sequence lengths, so the freed
blocks leave holes that later tensors do not fit: the resident set grows far past the bytes in
use. On SmolLM2-135M (30 layers, 4 pairs of up to 512 tokens, fp32) the resident set exceeded
the bytes in use by 2.7-4.3 GiB at a step's peak, about 0.5 GiB of it code and libraries
(``docs/BENCHMARKS.md``, "Where a step's peak memory goes").

The engine runs with two glibc tunables (``GLIBC_TUNABLES``, :data:`TUNABLES`):

* ``glibc.malloc.mmap_threshold=4194304``: blocks of 4 MiB and more (every activation of a real
  model) are mapped when made and unmapped when freed, at a threshold glibc no longer raises; the
  small blocks stay in the heap.
* ``glibc.malloc.hugetlb=1``: those mappings ask for transparent huge pages (``madvise``), so
  mapping a block costs one page fault per 2 MiB instead of one per 4 KiB. Without it the mapped
  blocks made steps 13% slower on the 4-layer cut; with it no slower than the heap. Where the
  kernel offers no transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` =
  ``never``) only the threshold applies.

glibc reads ``GLIBC_TUNABLES`` once, when a process starts, so :func:`restart_with_malloc_tunables`
re-executes the process (same PID, arguments and descriptors) with them before anything is
imported; the training entry point calls it first. Launchers need not know about it. Nothing
changes when the C library is not glibc, when ``GLIBC_TUNABLES`` already sets a ``glibc.malloc``
tunable (the user's own choice), or with ``DPO_MEGATRON_HOST_MALLOC=system``. The loss is the
same either way: only where the bytes live changes.

This module imports nothing beyond the standard library: it runs before torch is imported.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

TUNABLES = ("glibc.malloc.mmap_threshold=4194304", "glibc.malloc.hugetlb=1")
"""The engine's glibc malloc tunables (module docstring)."""

OPT_OUT = "DPO_MEGATRON_HOST_MALLOC"
"""Environment variable: ``system`` leaves glibc's own malloc behaviour."""


def malloc_env(environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """``environ`` with :data:`TUNABLES` added to ``GLIBC_TUNABLES``, or None when nothing is
    to change: not glibc, ``DPO_MEGATRON_HOST_MALLOC=system``, or ``GLIBC_TUNABLES`` already sets
    a ``glibc.malloc`` tunable (the engine's own, or the user's)."""
    if platform.libc_ver()[0] != "glibc" or environ.get(OPT_OUT, "") == "system":
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
