"""The C allocator on CPU runs: free heap pages go back to the OS, by default or by setting.

On a GPU, PyTorch's caching allocator owns the device memory. On the CPU (gloo), every tensor is a
``malloc`` of the C library. glibc serves a block below its mmap threshold from the heap, and each
time it frees a mapped block it raises that threshold to the block's size (up to 32 MiB), so from
the first step on nearly every activation lives in the heap. A forward pass frees its transients
(norm and RoPE intermediates, projections' outputs) between the activations it keeps, and glibc
does not fit the next layer's tensors into all of those holes: the freed pages stay resident,
and the resident set exceeds the tensors in use by gigabytes on SmolLM2-135M (measured in
``docs/BENCHMARKS.md``, "Free heap pages returned between layers").

``DPO_MEGATRON_HOST_MALLOC`` (:data:`SWITCH`) chooses what the engine does about it:

* unset or ``trim`` (the default): after each transformer layer's forward in the policy, and
  when backward reaches the layer (the activations that backward frees stay resident as free
  heap, and the gradients made later, the word embeddings' among them, do not all fit in its
  holes), a :class:`HeapTrimmer` checks how much free heap is resident and, past
  :data:`TRIM_SLACK_BYTES`,
  calls glibc's ``malloc_trim(0)`` (:func:`release_free_heap`), which returns every whole page
  of the heap's free blocks to the OS (``madvise(MADV_DONTNEED)``) and keeps the blocks
  themselves, so the resident set stays within that bound of the bytes in use (per process).
  Trimming after every layer keeps the resident set lowest but slows a step: each trim also
  hands back pages the next layer's transients reuse, which the kernel maps and zeroes again.
  The bound trims every few layers instead.
  In this mode every block also comes from the heap (:func:`heap_only`): glibc maps a block
  above its largest mmap threshold (32 MiB) afresh at each ``malloc`` and unmaps it at ``free``,
  so such a tensor (a layer's [tokens, 2 x ffn] gate/up output: 37.5 MiB for 3,056 tokens of
  SmolLM2) would have every page faulted in and zeroed by the kernel each time; from the heap it
  reuses freed pages, and the trimmer's bound still caps what the heap keeps.
* ``release``: glibc's tunables :data:`TUNABLES` (``GLIBC_TUNABLES``):
  ``glibc.malloc.mmap_threshold=4194304`` maps every block of 4 MiB and more when made and unmaps
  it when freed, and ``glibc.malloc.hugetlb=1`` asks for transparent huge pages for those
  mappings. The resident set is about the same as with ``trim``, but mapping and zeroing fresh
  pages for every large tensor makes a step slower.
* ``system``: glibc as it comes, nothing trimmed: the largest resident set.

The memory and step time of each mode, measured: ``docs/BENCHMARKS.md``.

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
from collections.abc import Mapping, Sequence

TUNABLES = ("glibc.malloc.mmap_threshold=4194304", "glibc.malloc.hugetlb=1")
"""The engine's glibc malloc tunables (module docstring)."""

SWITCH = "DPO_MEGATRON_HOST_MALLOC"
"""Environment variable: ``trim`` (the default when unset), ``release`` or ``system`` (module
docstring)."""

MODES = ("trim", "release", "system")


class HostMallocError(ValueError):
    """:data:`SWITCH` holds a value not in :data:`MODES`."""


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """The host malloc mode :data:`SWITCH` selects: ``trim`` when unset.

    Raises:
        HostMallocError: a value not in :data:`MODES`.
    """
    value = environ.get(SWITCH, "") or "trim"
    if value not in MODES:
        raise HostMallocError(
            f"{SWITCH}={value!r}: expected one of {', '.join(MODES)} (unset means trim)"
        )
    return value


def _glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def malloc_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with :data:`TUNABLES` added to ``GLIBC_TUNABLES``, or None when nothing is
    to change: ``DPO_MEGATRON_HOST_MALLOC`` is not ``release``, not glibc, or ``GLIBC_TUNABLES``
    already sets a ``glibc.malloc`` tunable (the engine's own, or the user's).

    Raises:
        HostMallocError: an unknown ``DPO_MEGATRON_HOST_MALLOC`` (:func:`mode`).
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
    except HostMallocError as exc:  # before torch: one line from rank 0, not a traceback per rank
        from dpo_megatron.utils.exits import fail

        fail(f"error: {exc}")
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


def malloc_in_use() -> int:
    """Bytes the C allocator has handed out and not taken back (glibc ``mallinfo2``: heap in use
    + mapped blocks), or 0 where that is not available. RSS minus this is allocator slack (and
    code, libraries and the interpreter's own arenas)."""
    mallinfo2 = _mallinfo2() if _glibc() else None
    if mallinfo2 is None:
        return 0
    info = mallinfo2()
    return info.uordblks + info.hblkhd


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.lru_cache(maxsize=1)
def _mallinfo2():
    """glibc's ``mallinfo2`` with its return type set, looked up once (it is read after every
    layer), or None before glibc 2.33."""
    try:
        function = _libc().mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def resident_bytes() -> int:
    """This process's resident set in bytes (``/proc/self/statm``), or 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL("libc.so.6")


M_MMAP_MAX = -4
"""glibc's ``mallopt`` parameter: the most blocks it maps at once (0: none, every block from the
heap)."""


def heap_only() -> bool:
    """Have glibc serve every later block from the heap, however large (``mallopt(M_MMAP_MAX,
    0)``); returns whether it took. Blocks mapped before stay mapped until freed. Process-wide
    and for good: :func:`trim_after_each_layer` calls it where a :class:`HeapTrimmer` bounds the
    heap's free pages (module docstring)."""
    return _glibc() and _libc().mallopt(M_MMAP_MAX, 0) == 1


TRIM_SLACK_BYTES = 512 << 20
"""Resident free heap a layer's forward may leave before :class:`HeapTrimmer` trims."""


class HeapTrimmer:
    """Trims the C heap (:func:`release_free_heap`) when its resident free pages exceed a bound.

    Trimming after every layer keeps the resident set lowest, but each trim also hands back the
    pages of blocks the next layer's transients reuse, and the kernel then maps and zeroes them
    again (a slower step: ``docs/BENCHMARKS.md``). So each call estimates the resident
    free heap as RSS - bytes in use - the non-heap rest (code, libraries, the interpreter's
    arenas: RSS - bytes in use just after the last trim) and trims only above ``slack_bytes``:
    the peak keeps at most about that much slack, at a trim every few layers. Growth outside
    the C heap (the interpreter's arenas, mapped files) reads as free heap until the next trim
    measures the rest again: at worst an early trim.

    Args:
        slack_bytes: the bound (:data:`TRIM_SLACK_BYTES`); negative: trim at every call.
        rss, in_use: readers of the resident set and the allocator's bytes in use
            (:func:`resident_bytes`, :func:`malloc_in_use`; replaced in tests). Where either reads
            0 (not Linux / glibc before 2.33) every call trims.
    """

    def __init__(
        self, slack_bytes: int = TRIM_SLACK_BYTES, rss=resident_bytes, in_use=malloc_in_use
    ):
        self.slack_bytes, self.rss, self.in_use = slack_bytes, rss, in_use
        self.rest: int | None = None  # RSS - bytes in use after the last trim
        self.trims = 0

    def after_forward(self, module, args, output) -> None:
        """A transformer layer's forward hook: check now, and again when backward reaches the
        layer (a hook on its output's gradient), where the activations that backward frees
        stay resident as free heap."""
        hidden = output[0] if isinstance(output, tuple) else output
        if torch_grad_enabled() and getattr(hidden, "requires_grad", False):
            hidden.register_hook(lambda grad: self())
        self()

    def __call__(self, *hook_args) -> None:
        if self.rest is not None and self.slack_bytes >= 0:
            rss, used = self.rss(), self.in_use()
            if rss and used and rss - used - self.rest <= self.slack_bytes:
                return
        release_free_heap()
        self.trims += 1
        self.rest = self.rss() - self.in_use()


def torch_grad_enabled() -> bool:
    """torch's grad mode (torch imported here only once a trimmer runs: module docstring)."""
    import torch

    return torch.is_grad_enabled()


def trim_after_each_layer(
    model_chunks: Sequence, device, trimmer: HeapTrimmer | None = None
) -> HeapTrimmer | None:
    """In ``trim`` mode on a CPU device with glibc, call a :class:`HeapTrimmer` after every
    transformer layer's forward in ``model_chunks`` (a forward hook, so also in recomputed
    forwards, and with LoRA in the reference pass, which runs the policy's own layers) and,
    where the layer's output takes a gradient, when backward reaches it
    (:meth:`HeapTrimmer.after_forward`), and
    serve every block from the heap from now on (:func:`heap_only`); elsewhere nothing. The
    trimmer is per process: each rank keeps its own bound.

    Args:
        model_chunks: the policy's model chunks (``torch.nn.Module``, DDP-wrapped or not).
        device: the engine's ``torch.device``: on a GPU the activations are not the C heap's.
        trimmer: the trimmer to call (default: a new one with :data:`TRIM_SLACK_BYTES`).

    Returns:
        the trimmer (its ``trims`` count the trims), or None in another mode or on a GPU.

    Raises:
        HostMallocError: an unknown ``DPO_MEGATRON_HOST_MALLOC`` (:func:`mode`).
    """
    if mode() != "trim" or device.type != "cpu" or not _glibc():
        return None
    from megatron.core.transformer.transformer_layer import TransformerLayer

    trimmer = trimmer or HeapTrimmer()
    heap_only()
    for chunk in model_chunks:
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                layer.register_forward_hook(trimmer.after_forward)
    return trimmer  # also on a stage without layers: every rank runs in the same mode


def describe(environ: Mapping[str, str] = os.environ, trimming: bool = False) -> str:
    """One phrase for the start-up line: the malloc tunables in force (``release`` or the user's
    own), or glibc's default, and with ``trimming`` that free heap pages are returned between
    layers (``trim``)."""
    active = [
        t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")
    ]
    tunables = ", ".join(t[len("glibc.malloc.") :] for t in active)
    if trimming:
        return (
            "host malloc: trim (every block from the heap, free heap pages returned between "
            "layers; " + (tunables or "no glibc tunables") + ")"
        )
    return "host malloc: " + (tunables or "the C library's default")
