"""compat.tensorboard_writer_thread: a failed append of TensorBoard's event-writer thread (a
full disk here) is raised by the writer in the caller's thread, and no longer printed by the
thread as well."""

import os
import threading

import pytest

from dpo_megatron.compat import tensorboard_writer_thread
from dpo_megatron.compat.tensorboard_writer_thread import quiet_writer_thread_errors
from tests.checkpointing.test_storage import fill, small_tmpfs


def _fill_and_write(folder) -> None:
    """A SummaryWriter in ``folder`` writing on after its disk filled up: the writer raises
    the OSError in this thread; its own thread has ended when this returns."""
    from torch.utils.tensorboard import SummaryWriter

    before = set(threading.enumerate())
    writer = SummaryWriter(str(folder))
    (thread,) = set(threading.enumerate()) - before
    filler = fill(os.path.dirname(folder))
    try:
        with pytest.raises(OSError, match="No space left on device"):
            for step in range(100_000):  # until a new page of the event file is needed
                writer.add_scalar("train/loss", 0.5, step)
                writer.flush()
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        os.remove(filler)


def test_the_writer_raises_a_full_disk_and_its_thread_no_longer_prints_it(tmp_path, monkeypatch):
    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)  # Python's printing hook
    monkeypatch.setattr(tensorboard_writer_thread, "_installed", [])
    with small_tmpfs(tmp_path / "disk", "512k") as disk:
        _fill_and_write(disk / "unpatched")  # tensorboard's own behaviour: printed as well
        assert [type(args.exc_value) for args in printed] == [OSError]
        printed.clear()
        assert quiet_writer_thread_errors()
        _fill_and_write(disk / "patched")
        assert printed == []
        # any other thread's exception still reaches the hook that was there
        other = threading.Thread(target=lambda: 1 / 0)
        other.start()
        other.join()
        assert [type(args.exc_value) for args in printed] == [ZeroDivisionError]
