"""parallel.host_malloc: by default (trim) the policy's layers return the C heap's free pages to
the OS after each forward; with DPO_MEGATRON_HOST_MALLOC=release the engine's processes run with
glibc's malloc tunables, so that large freed tensors go back to the OS; the user's own setting
and system (nothing) are kept."""

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
    assert env == {
        "PATH": "/bin",
        **on,
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304:glibc.malloc.hugetlb=1",
    }
    assert host_malloc.malloc_env(env) is None  # already restarted: no loop
    other = host_malloc.malloc_env({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F", **on})
    assert other["GLIBC_TUNABLES"] == (
        "glibc.cpu.hwcaps=-AVX512F:" + ":".join(host_malloc.TUNABLES)
    )
    assert host_malloc.malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", **on}) is None
    assert host_malloc.malloc_env({"PATH": "/bin"}) is None  # off by default
    assert host_malloc.malloc_env({"DPO_MEGATRON_HOST_MALLOC": "system"}) is None
    assert host_malloc.describe(env) == "host malloc: mmap_threshold=4194304, hugetlb=1"
    assert host_malloc.describe({}) == "host malloc: the C library's default"
    assert host_malloc.describe({}, trimming=True) == (
        "host malloc: trim (every block from the heap, free heap pages returned between "
        "layers; no glibc tunables)"
    )
    assert (
        host_malloc.describe({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, trimming=True)
        == "host malloc: trim (every block from the heap, free heap pages returned between "
        "layers; arena_max=2)"
    )


def test_mode_is_trim_unless_set_and_a_typo_is_an_error():
    assert host_malloc.mode({}) == host_malloc.mode({"DPO_MEGATRON_HOST_MALLOC": ""}) == "trim"
    for value in ("trim", "release", "system"):
        assert host_malloc.mode({"DPO_MEGATRON_HOST_MALLOC": value}) == value
    with pytest.raises(
        ValueError, match="DPO_MEGATRON_HOST_MALLOC='relase': expected one of trim, release, system"
    ):
        host_malloc.malloc_env({"DPO_MEGATRON_HOST_MALLOC": "relase"})


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
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "a", "b=1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    pids = [line for line in out if line.startswith("pid")]
    # the restart re-executes the same process: its first line twice, with the same PID
    assert len(pids) == (1 if opt_out else 2) and len(set(pids)) == 1, out
    mapped = "mapped False" if opt_out else "mapped True"
    assert out[-1].startswith(mapped) and "args ['a', 'b=1']" in out[-1], out
    assert ("hugetlb=1" in out[-1]) != opt_out


def test_a_typo_stops_the_entry_point_with_one_line():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "DPO_MEGATRON_HOST_MALLOC": "on"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2 and out.stderr.strip() == (  # utils.exits.USER_ERROR_EXIT
        "error: DPO_MEGATRON_HOST_MALLOC='on': expected one of trim, release, system "
        "(unset means trim)"
    ), out.stderr


# 64 heap blocks of 1 MiB, written (resident), then every other one freed: 32 MiB of holes that
# glibc keeps resident because a block in use follows each. release_free_heap hands their pages
# back; the blocks in use keep their bytes.
TRIM_PROBE = """
import ctypes
from dpo_megatron.parallel.host_malloc import release_free_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for i, b in enumerate(blocks):
    ctypes.memset(b, i + 1, 1 << 20)
for b in blocks[0::2]:
    libc.free(b)
before = rss()
release_free_heap()
after = rss()
kept = all(ctypes.string_at(b + 4096 * k, 1)[0] == i + 1
           for i, b in list(enumerate(blocks))[1::2] for k in range(256))
print((before - after) >> 20, kept)
"""


@glibc
def test_release_free_heap_returns_the_pages_of_freed_blocks():
    # the heap, not mmap: glibc's threshold fixed above the blocks' size
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": ".",
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432",
    }
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.split()
    released_mib, kept = int(out[0]), out[1]
    assert 30 <= released_mib <= 34 and kept == "True", out


def test_the_trimmer_trims_when_the_resident_free_heap_passes_its_bound(monkeypatch):
    trims = []
    monkeypatch.setattr(host_malloc, "release_free_heap", lambda: trims.append(1))
    mib = 1 << 20
    state = {"rss": 1000 * mib, "used": 600 * mib}  # 400 MiB of code, libraries, interpreter
    trimmer = host_malloc.HeapTrimmer(
        100 * mib, rss=lambda: state["rss"], in_use=lambda: state["used"]
    )
    trimmer()  # the first call trims and learns the non-heap rest
    assert (len(trims), trimmer.rest) == (1, 400 * mib)
    state.update(rss=1700 * mib, used=1250 * mib)  # 50 MiB of resident free heap: kept
    trimmer()
    assert len(trims) == 1
    state.update(rss=1801 * mib, used=1300 * mib)  # 101 MiB: trimmed
    trimmer()
    assert len(trims) == 2 and trimmer.trims == 2
    state.update(rss=1800 * mib, used=1400 * mib)  # after the trim: 0 free heap resident
    trimmer()
    assert len(trims) == 2
    state.update(rss=0)  # no /proc: every call trims
    trimmer()
    assert len(trims) == 3


def _count_trims(switch, device, slack, recompute):
    """Trims in three forwards of a 3-layer chunk (one with backward), and its first output."""
    import os

    import torch

    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    os.environ.pop(host_malloc.SWITCH, None)
    if switch:
        os.environ[host_malloc.SWITCH] = switch
    initialize_distributed(ParallelConfig())
    set_seed(0)
    extra = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute
        else {}
    )
    chunks = build_model_chunks(
        ModelConfig(
            num_layers=3,
            hidden_size=32,
            ffn_hidden_size=64,
            num_attention_heads=2,
            vocab_size=64,
            **extra,
        ),
        ParallelConfig(),
    )
    trimmer = host_malloc.trim_after_each_layer(
        chunks, torch.device(device), host_malloc.HeapTrimmer(slack)
    )
    tokens = torch.randint(0, 64, (2, 5))
    first = chunks[0](tokens, torch.arange(5).expand(2, 5), attention_mask=None)
    chunks[0](tokens, torch.arange(5).expand(2, 5), attention_mask=None).sum().backward()
    chunks[0](tokens, torch.arange(5).expand(2, 5), attention_mask=None)
    # a 48 MiB tensor, above glibc's largest mmap threshold: mapped unless heap_only() took
    mapped_before = host_malloc._mallinfo2()().hblkhd
    large = torch.ones(48 << 20, dtype=torch.uint8)
    mapped = host_malloc._mallinfo2()().hblkhd - mapped_before >= 48 << 20
    del large
    return trimmer and trimmer.trims, first.detach(), mapped


@glibc
@pytest.mark.parametrize(
    "switch, device, slack, recompute, trims",
    [
        ("", "cpu", -1, False, 12),
        ("trim", "cpu", -1, False, 12),
        ("", "cpu", -1, True, 15),
        ("", "cpu", 1 << 40, False, 1),
        ("system", "cpu", -1, False, None),
        ("release", "cpu", -1, False, None),
        ("", "cuda", -1, False, None),
    ],
)
def test_the_policys_layers_trim_on_cpu_only(switch, device, slack, recompute, trims):
    import torch

    from tests.multirank import run_ranks

    # 3 forwards x 3 layers with no bound and the 3 layers reached by the one backward (with
    # full recompute also the 3 layers' forwards recomputed in it); with a bound no tiny model
    # passes, only the first call; no trimmer outside trim mode on CPU
    (result,) = run_ranks(
        _count_trims, world_size=1, switch=switch, device=device, slack=slack, recompute=recompute
    )
    (untrimmed,) = run_ranks(
        _count_trims, world_size=1, switch="system", device="cpu", slack=slack, recompute=recompute
    )
    assert result[0] == trims
    assert torch.equal(result[1], untrimmed[1])  # trimming moves no byte in use
    # with a trimmer every block comes from the heap (heap_only); elsewhere glibc maps it
    assert result[2] is (trims is None) and untrimmed[2] is True
