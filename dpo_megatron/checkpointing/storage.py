"""Writing a checkpoint folder so that a failure never leaves a half checkpoint that counts.

:class:`CheckpointWriter` is the one way checkpoints reach the disk (model-only and training
checkpoints alike):

1. **Pre-flight** (rank 0, before anything is written): the save folder must be writable and
   its file system must have room for the checkpoint (the caller's estimate, summed over ranks).
   A full or read-only disk is then reported before any rank starts writing.
2. **Phases** (``writer.phase(fn)``): every rank runs ``fn(tmp)`` writing into
   ``<ckpt_dir>.tmp``; the ranks then agree on whether any of them failed, so all of them raise
   the same error instead of some waiting forever in the next collective.
3. **Commit**: the manifest (sizes and XXH3-128 digests of every file,
   :mod:`~dpo_megatron.checkpointing.integrity`) is written last, then rank 0 renames the folder
   into place (an existing checkpoint of the same name is replaced only then).

On any failure the ``.tmp`` folder is removed (it would otherwise keep the space a resume needs)
and :class:`CheckpointSaveError` says what happened: ``no space left on device`` / ``read-only
file system`` / ``permission denied`` with the path, from the OSError's errno wherever it is in
the exception chain (torch's zip writer reports a full disk as ``enforce fail at
inline_container.cc ... unexpected pos``: then the file system itself is asked). Checkpoints
already in the save folder are never touched by a failed save.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable

from dpo_megatron.utils import ranks
from dpo_megatron.utils.exceptions import exceptions_in
from dpo_megatron.utils.files import replace_dir

_RESERVE_BYTES = 1 << 20
"""Free space kept beyond the estimate (plus 5% of it): file-system blocks, the small files
(JSON, RNG states, DCP's index), rounding."""


class StorageError(RuntimeError):
    """A write of the run met a full, read-only or forbidden disk (or another ``OSError``): a
    checkpoint, the run folder at the start, or rank 0's logs between saves. Every rank raises
    it at the same point; the message names the file, the cause and what was kept. The entry
    points end the ranks with ``utils.exits.FAULT_EXIT``."""


class CheckpointSaveError(StorageError):
    """A checkpoint could not be written; the message names the path and the cause. The
    ``.tmp`` folder is removed and earlier checkpoints are intact."""


def free_bytes(path: str) -> int:
    """Bytes available to this user on the file system holding ``path`` (or its nearest
    existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _read_only(path: str) -> bool:
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _find_oserror(exc: BaseException) -> OSError | None:
    """The first OSError with an errno among :func:`exceptions_in` ``exc``."""
    return next((e for e in exceptions_in(exc) if isinstance(e, OSError) and e.errno), None)


def describe_storage_error(exc: BaseException, path: str) -> str:
    """One line for a failed write under ``path``: the cause in words and the path."""
    os_error = _find_oserror(exc)
    code = os_error.errno if os_error is not None else None
    where = os_error.filename if os_error is not None and os_error.filename else path
    if code is None:  # no errno survived (torch's zip writer): ask the file system
        if _read_only(path):
            code = errno.EROFS
        elif free_bytes(path) < _RESERVE_BYTES:
            code = errno.ENOSPC
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on device writing {where} ({free_bytes(path) / 1e6:.1f} MB free there)"
        )
    if code == errno.EROFS:
        return f"read-only file system: cannot write {where}"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied writing {where}"
    detail = str(exc).strip().splitlines()
    return f"{type(exc).__name__} writing {where}: {detail[0] if detail else ''}"


class CheckpointWriter:
    """One atomic checkpoint save (collective: every rank creates one and runs the same phases).

    Args:
        ckpt_dir: the final checkpoint folder.
        local_bytes: this rank's estimate of the bytes it will write (summed over ranks for the
            free-space check; 0 skips that check).

    Raises (from the constructor, :meth:`phase` and :meth:`commit`):
        CheckpointSaveError: on every rank, naming the path and the cause.
    """

    def __init__(self, ckpt_dir: str, local_bytes: int = 0):
        self.ckpt_dir = os.path.abspath(ckpt_dir)
        self.tmp = f"{self.ckpt_dir}.tmp"
        self.started = time.perf_counter()
        self.manifest: dict | None = None
        """The manifest written by :meth:`commit` (None before)."""
        self.hash_seconds = 0.0
        """Wall time of the manifest phase (every rank hashing its share, then the gather)."""
        total = sum(ranks.gather_to_all(int(local_bytes)))
        error = None
        if ranks.is_rank0():
            error = self._prepare(total)
        self._agree(error)

    def _prepare(self, needed: int) -> str | None:
        parent = os.path.dirname(self.ckpt_dir)
        try:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)  # a save killed earlier
            free = free_bytes(parent)
            if needed and free < needed * 1.05 + _RESERVE_BYTES:
                return (
                    f"no space left on device for checkpoint {self.ckpt_dir}: it needs "
                    f"about {needed / 1e6:.1f} MB, {free / 1e6:.1f} MB free on the file "
                    f"system of {parent}"
                )
            os.makedirs(self.tmp)
        except OSError as e:
            return describe_storage_error(e, parent)
        return None

    def phase(self, fn: Callable[[str], None]) -> None:
        """Run ``fn(tmp_folder)`` on this rank, then agree with the other ranks on failures."""
        error = None
        try:
            fn(self.tmp)
        except (KeyboardInterrupt, SystemExit):
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        except BaseException as e:  # torch DCP's CheckpointException is a BaseException
            error = describe_storage_error(e, self.tmp)
            self._cause = e
        self._agree(error)

    def commit(self) -> None:
        """Write the manifest, then rename the folder into place (rank 0)."""
        from dpo_megatron.checkpointing.integrity import write_manifest

        self.phase(lambda tmp: None)  # a barrier before hashing: every file is written
        hashing = time.perf_counter()

        def manifest(tmp: str) -> None:
            self.manifest = write_manifest(tmp)

        self.phase(manifest)
        self.hash_seconds = time.perf_counter() - hashing
        self.phase(lambda tmp: replace_dir(tmp, self.ckpt_dir) if ranks.is_rank0() else None)

    def report(self) -> str:
        """After :meth:`commit`: ``wrote <folder> (N files, SIZE in S s; checksums H s)``, the
        cost of the manifest (hashing every file once more) next to that of the whole save."""
        from dpo_megatron.checkpointing.integrity import describe_size

        files = self.manifest["files"] if self.manifest else {}
        size = describe_size(self.manifest["total_bytes"] if self.manifest else 0)
        return (
            f"wrote checkpoint {self.ckpt_dir} ({len(files)} files, {size} in "
            f"{time.perf_counter() - self.started:.2f} s; checksums {self.hash_seconds:.2f} s)"
        )

    def _agree(self, error: str | None) -> None:
        errors = ranks.agreed_errors(error)
        if not errors:
            return
        if error:  # the failing rank removes the folder itself too: others may be gone
            shutil.rmtree(self.tmp, ignore_errors=True)
        ranks.barrier()
        if ranks.is_rank0():
            shutil.rmtree(self.tmp, ignore_errors=True)
        raise CheckpointSaveError(
            f"saving checkpoint {self.ckpt_dir} failed: {'; '.join(errors)}. Removed "
            f"{os.path.basename(self.tmp)}; earlier checkpoints in "
            f"{os.path.dirname(self.ckpt_dir)} are untouched"
        ) from getattr(self, "_cause", None)
