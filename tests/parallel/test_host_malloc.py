"""parallel.host_malloc: with DPO_MEGATRON_HOST_MALLOC=release the engine's processes run with
glibc's malloc tunables, so that large freed tensors go back to the OS; the user's own setting
and the default (off) are kept."""

import platform
import subprocess
import sys

import pytest

from dpo_megatron.parallel import host_malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


@glibc
def test_tunables_are_added_once_and_a_users_choice_is_kept():
    on = {"DPO_MEGATRON_HOST_MALLOC": "release"}
    env = host_malloc.malloc_env({"PATH": "/bin", **on})
    assert env == {"PATH": "/bin", **on, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304:"
                                                           "glibc.malloc.hugetlb=1"}
    assert host_malloc.malloc_env(env) is None  # already restarted: no loop
    other = host_malloc.malloc_env({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F", **on})
    assert other["GLIBC_TUNABLES"] == ("glibc.cpu.hwcaps=-AVX512F:" + ":".join(
        host_malloc.TUNABLES))
    assert host_malloc.malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", **on}) is None
    assert host_malloc.malloc_env({"PATH": "/bin"}) is None  # off by default
    assert host_malloc.malloc_env({"DPO_MEGATRON_HOST_MALLOC": "system"}) is None
    assert host_malloc.describe(env) == "host malloc: mmap_threshold=4194304, hugetlb=1"
    assert host_malloc.describe({}) == "host malloc: the C library's default"


def test_not_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert host_malloc.malloc_env({"DPO_MEGATRON_HOST_MALLOC": "release"}) is None


# Two 8 MiB blocks one after the other: glibc maps the first, and on its free raises the mmap
# threshold past 8 MiB, so by default the second comes from the heap; with the engine's tunables
# both are mapped (mallinfo2's hblkhd counts mapped bytes in use).
PROBE = """
import ctypes, os, sys
from dpo_megatron.parallel.host_malloc import restart_with_malloc_tunables
print("pid", os.getpid(), flush=True)
restart_with_malloc_tunables()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))
block = libc.malloc(8 << 20)
print("mapped", libc.mallinfo2().hblkhd >= 8 << 20, "args", sys.argv[1:],
      "tunables", os.environ.get("GLIBC_TUNABLES", ""))
"""


@glibc
@pytest.mark.parametrize("opt_out", [False, True], ids=["release", "default"])
def test_restart_maps_large_blocks_in_the_same_process(opt_out):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    if not opt_out:
        env["DPO_MEGATRON_HOST_MALLOC"] = "release"
    out = subprocess.run([sys.executable, "-c", PROBE, "a", "b=1"], capture_output=True,
                         text=True, env=env, timeout=120, check=True).stdout.splitlines()
    pids = [line for line in out if line.startswith("pid")]
    # the restart re-executes the same process: its first line twice, with the same PID
    assert len(pids) == (1 if opt_out else 2) and len(set(pids)) == 1, out
    mapped = "mapped False" if opt_out else "mapped True"
    assert out[-1].startswith(mapped) and "args ['a', 'b=1']" in out[-1], out
    assert ("hugetlb=1" in out[-1]) != opt_out
