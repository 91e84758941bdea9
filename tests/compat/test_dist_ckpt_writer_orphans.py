"""compat.dist_ckpt_writer_orphans: the writer processes megatron-core forks at a save die with
their rank. Without the patch a writer has no parent-death signal; with it, a writer whose rank
is killed with SIGKILL in the middle of a save is gone at once instead of writing on."""

import multiprocessing as mp
import os
import signal
import time

import pytest


def _rank_that_saves(folder: str, patched: bool, pids) -> None:
    """A stand-in rank: a real ``write_preloaded_data_multiproc`` whose writers report their
    pid and parent-death signal, then hang as a writer still busy writing would."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from dpo_megatron.compat import dist_ckpt_writer_orphans
    from dpo_megatron.utils.processes import parent_death_signal

    def slow_write(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, **kw):
        pids.put((os.getpid(), parent_death_signal()))
        time.sleep(60)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow_write)
    if patched:
        assert dist_ckpt_writer_orphans.writers_die_with_their_rank() is True
        assert dist_ckpt_writer_orphans.writers_die_with_their_rank() is True  # idempotent
    buckets = [(os.path.join(folder, "a.distcp"), "a", ([], []))]
    FileSystemWriterAsync.write_preloaded_data_multiproc([], False, 0, buckets, mp.Queue())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("patched", [False, True], ids=["without", "with"])
def test_a_writer_dies_with_its_rank_only_with_the_patch(tmp_path, patched):
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc")
    ctx = mp.get_context("fork")
    pids = ctx.Queue()
    rank = ctx.Process(target=_rank_that_saves, args=(str(tmp_path), patched, pids))
    rank.start()
    writer, signum = pids.get(timeout=60)
    assert signum == (signal.SIGKILL if patched else 0)
    os.kill(rank.pid, signal.SIGKILL)
    rank.join()
    deadline = time.monotonic() + 10
    while _alive(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _alive(writer) is not patched  # an orphan writes on without the patch
    finally:
        if _alive(writer):
            os.kill(writer, signal.SIGKILL)
