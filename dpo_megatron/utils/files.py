"""Atomic writes: a reader sees the old file (or folder) or the new one, never half of one.

Each write goes to a temporary name next to its target (same file system) and is renamed onto
the target when complete; on error the temporary is removed and the target is left as it was.
Temporaries get ordinary permissions (``mkstemp`` / ``mkdtemp`` make them private).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_permissions(path: str | os.PathLike) -> None:
    """Give ``path`` (and a folder's direct files) the permissions the umask gives a new file:
    ``mkdtemp`` / ``mkstemp`` create them private (0o700 / 0o600)."""
    mask = _umask()
    if os.path.isdir(path):
        os.chmod(path, 0o777 & ~mask)
        for child in os.scandir(path):
            if child.is_file(follow_symlinks=False):
                os.chmod(child.path, 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Persist a folder's entries (a rename into it) where the file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, fsync: bool = True) -> Iterator[str]:
    """Yield a temporary path next to ``path``; the caller writes the whole file there, and on a
    clean exit it is (fsynced and) renamed onto ``path``. The parent folder is created.

    Args:
        path: the target file.
        fsync: flush the file's data to disk before the rename (a crash right after the rename
            then cannot leave an empty file).

    Raises:
        Whatever the caller's block raises (the temporary is removed first), or OSError.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
    os.close(fd)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        publish_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_file`)."""
    with atomic_file(path, fsync=fsync) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON (indent 1) to ``path`` atomically, fsynced (never a half file)."""
    write_text_atomic(path, json.dumps(obj, indent=1))


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the complete folder ``tmp`` to ``final``; an existing ``final`` is moved aside
    first and deleted only after the rename (one process, e.g. rank 0, calls this)."""
    tmp, final = os.fspath(tmp), os.fspath(final)
    old = f"{final}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[str]:
    """Yield a fresh temporary folder next to ``final``; on a clean exit it replaces ``final``
    (:func:`replace_dir`: an existing ``final`` is removed only after the rename). On error the
    temporary folder is removed and ``final`` is left as it was.

    Raises:
        Whatever the caller's block raises, or OSError (the parent cannot be written).
    """
    final = os.path.abspath(os.fspath(final))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=os.path.dirname(final))
    try:
        yield tmp
        publish_permissions(tmp)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_folder(
    folder: str | os.PathLike, sources: Sequence[str | None] = (), overwrite: bool = False
) -> None:
    """Refuse ``folder`` as the output of a command that writes a whole folder and renames it
    into place (:func:`atomic_dir`: everything ``folder`` held is replaced): when it is, or
    holds, one of the ``sources`` it reads (paths that do not exist, e.g. hub names, are
    skipped), or, unless ``overwrite``, when it exists and is not empty. A folder inside a
    source is allowed (a run's ``checkpoints/hf``).

    Raises:
        ValueError: ``<folder> ...``, saying what would be lost and what to do.
    """
    final = os.path.realpath(folder)
    for source in sources:
        if source and os.path.exists(source):
            if os.path.commonpath([final, os.path.realpath(source)]) == final:
                raise ValueError(
                    f"{os.fspath(folder)} is or holds {source}, which this command reads: "
                    "writing it would replace it; pick another folder"
                )
    if not overwrite and os.path.isdir(final) and os.listdir(final):
        raise ValueError(
            f"{os.fspath(folder)} is not empty: the output replaces the whole folder, with "
            "everything it holds; pass --overwrite, or pick a new or empty folder"
        )
