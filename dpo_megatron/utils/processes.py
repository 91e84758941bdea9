"""A process that ends with its parent: Linux's parent-death signal (``prctl(2)``,
``PR_SET_PDEATHSIG``).

A worker started in a session of its own (torch elastic's ranks) or forked by a rank
(megatron-core's checkpoint writers) is not in its launcher's process group, so a SIGKILL of
that group leaves it running: a rank goes on training, a writer goes on writing into a
checkpoint folder the resumed run may reuse. The kernel's parent-death signal ends it instead.
The setting is not inherited across ``fork``: each process asks for itself.
"""

from __future__ import annotations

import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_GET_PDEATHSIG = 2


def _prctl(option: int, arg) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0)


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies. Returns True when
    set (Linux), False elsewhere. A parent that died before the request took effect (this
    process was re-parented already) ends this process at once with the same signal."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if _prctl(_PR_SET_PDEATHSIG, int(signum)) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
    return True


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (0: none; always 0 off Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    value = ctypes.c_int(0)
    if _prctl(_PR_GET_PDEATHSIG, ctypes.byref(value)) != 0:
        return 0
    return value.value


def child_pids(pid: int = 0) -> list[int]:
    """The live child processes of ``pid`` (0: this process), from ``/proc/<pid>/stat``'s
    parent field; empty where /proc is missing."""
    parent = pid or os.getpid()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(parent) and fields[0] != "Z":
            found.append(int(entry))
    return found
