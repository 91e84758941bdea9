"""The atomic checkpoint writer: a full or read-only disk says so with the path, removes its own
``.tmp`` and leaves the checkpoints beside it untouched (one process; injected errors and a real
small tmpfs where this machine allows mounting one)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

from dpo_megatron.checkpointing import storage
from dpo_megatron.checkpointing.integrity import MANIFEST_FILE, verify_checkpoint
from dpo_megatron.checkpointing.storage import CheckpointSaveError, CheckpointWriter


def _write(name: str, size: int):
    def fn(tmp):
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(os.urandom(size))

    return fn


def _save(ckpt_dir, *phases, local_bytes=0):
    writer = CheckpointWriter(str(ckpt_dir), local_bytes)
    for fn in phases:
        writer.phase(fn)
    writer.commit()
    return writer


def test_a_save_is_published_complete_with_its_manifest(tmp_path):
    _save(tmp_path / "iter_0000001", _write("a.bin", 1000), _write("b.bin", 10))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001"]
    assert verify_checkpoint(str(tmp_path / "iter_0000001")).files == 2
    assert os.path.isfile(tmp_path / "iter_0000001" / MANIFEST_FILE)


def test_a_save_reports_its_size_and_the_cost_of_its_checksums(tmp_path):
    """The report names the folder, the files and bytes the manifest lists (3 MB + 10 bytes
    here), and the seconds of the checksums within the seconds of the whole save."""
    import re

    ckpt = tmp_path / "iter_0000002"
    writer = _save(ckpt, _write("a.bin", 3_000_000), _write("b.bin", 10))
    assert writer.manifest["total_bytes"] == 3_000_010
    match = re.fullmatch(
        rf"wrote checkpoint {ckpt} \(2 files, 3\.0 MB in ([0-9.]+) s; "
        rf"checksums ([0-9.]+) s\)",
        writer.report(),
    )
    assert match, writer.report()
    total, hashing = map(float, match.groups())
    assert 0 <= hashing <= total and hashing == round(writer.hash_seconds, 2)


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.ENOSPC, "no space left on device"),
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
    ],
)
def test_an_os_error_during_a_save_is_named_and_cleaned_up(tmp_path, code, words):
    _save(tmp_path / "iter_0000001", _write("a.bin", 100))
    before = os.listdir(tmp_path / "iter_0000001")

    def fails(tmp):
        _write("half.bin", 50)(tmp)
        raise OSError(code, os.strerror(code), os.path.join(tmp, "half.bin"))

    with pytest.raises(CheckpointSaveError) as info:
        _save(tmp_path / "iter_0000002", _write("a.bin", 100), fails)
    message = str(info.value)
    assert words in message and "iter_0000002.tmp/half.bin" in message
    assert "Removed iter_0000002.tmp" in message
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001"]  # no .tmp, previous intact
    assert os.listdir(tmp_path / "iter_0000001") == before
    assert verify_checkpoint(str(tmp_path / "iter_0000001")).problems == []


def test_torch_zip_writer_error_without_errno_is_diagnosed_from_the_file_system(
    tmp_path, monkeypatch
):
    def fails(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(storage, "free_bytes", lambda path: 4096)
    with pytest.raises(CheckpointSaveError, match="no space left on device writing .*iter_1.tmp"):
        writer = CheckpointWriter(str(tmp_path / "iter_1"))
        writer.phase(fails)
    assert os.listdir(tmp_path) == []


def test_not_enough_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "free_bytes", lambda path: 50 << 20)
    with pytest.raises(CheckpointSaveError, match=r"needs about 100\.0 MB, 52\.4 MB free"):
        CheckpointWriter(str(tmp_path / "iter_1"), local_bytes=100_000_000)
    assert os.listdir(tmp_path) == []


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (skips the test where mounting is not allowed)."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder) -> str:
    """Write a file into ``folder`` until its file system is full; returns the file's path."""
    filler = os.path.join(folder, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def ext4_turning_read_only(path, size: str = "64M"):
    """An ext4 file system of ``size`` (an image file beside ``path``) mounted at ``path`` with
    ``errors=remount-ro``; yields its ``trigger_fs_error`` file: a line written there turns the
    file system read-only at once, open files included, as a disk error does (a plain ``mount
    -o remount,ro`` is refused while a file is open for writing). Skips the test where loop
    devices or mounting are not available."""
    os.makedirs(path, exist_ok=True)
    image = f"{path}.img"
    subprocess.run(["truncate", "-s", size, image], check=True)
    for cmd in (
        ["mkfs.ext4", "-q", "-F", image],
        ["mount", "-o", "loop,errors=remount-ro", image, str(path)],
    ):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            pytest.skip(f"no {e.filename} here")
        if done.returncode != 0:
            pytest.skip(f"cannot {cmd[0]} an ext4 image here: {done.stderr.strip()}")
    try:
        device = subprocess.run(
            ["findmnt", "-n", "-o", "SOURCE", str(path)], capture_output=True, text=True
        ).stdout.strip()
        trigger = f"/sys/fs/ext4/{os.path.basename(device)}/trigger_fs_error"
        if not os.path.exists(trigger):
            pytest.skip(f"no {trigger} here")
        yield trigger
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        os.remove(image)


def test_a_real_full_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        _save(disk / "iter_0000001", _write("a.bin", 400_000))
        # No estimate given (0): the writes themselves hit ENOSPC.
        with pytest.raises(CheckpointSaveError, match="no space left on device writing"):
            _save(disk / "iter_0000002", _write("a.bin", 800_000))
        assert sorted(os.listdir(disk)) == ["iter_0000001"]
        assert verify_checkpoint(str(disk / "iter_0000001")).problems == []
        # With the estimate, the same save is refused before a byte is written.
        with pytest.raises(CheckpointSaveError, match="needs about 0.8 MB"):
            _save(disk / "iter_0000002", _write("a.bin", 800_000), local_bytes=800_000)
        assert sorted(os.listdir(disk)) == ["iter_0000001"]


def test_a_real_read_only_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        _save(disk / "iter_0000001", _write("a.bin", 1000))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(CheckpointSaveError, match="read-only file system"):
            _save(disk / "iter_0000002", _write("a.bin", 1000))
        assert sorted(os.listdir(disk)) == ["iter_0000001"]
        assert verify_checkpoint(str(disk / "iter_0000001")).problems == []
