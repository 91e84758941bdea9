"""One run per run folder: its lock, the refusal to mix runs, ``config.yaml`` and ``train.log``.

:meth:`RunFolder.open` (collective; rank 0 acts, every rank gets the verdict) runs first in the
:class:`~dpo_megatron.training.trainer.Trainer`, before any model or data is built:

1. **Lock.** ``<run_dir>/run.lock`` is locked exclusively (``flock``) for the life of the run and
   names its owner (host, pid, start time, command). A second run on the same folder is refused
   with that owner in the message. A lock whose owner died (``kill -9``, a lost node) is released
   by the kernel with the process, so it is stale by construction: the next run takes it and
   says whose it was. On file systems without ``flock`` the owner's pid and start time are
   checked instead (same host), and a lock from another host is reported for a person to judge.
2. **No mixing.** A fresh run (``checkpoint.resume=none``) in a folder that already holds a
   run's checkpoints or metrics is refused, nothing deleted, unless ``checkpoint.overwrite=true``:
   then the old run's files move, untouched, to ``<run_dir>.replaced-<time>/`` (and an outside
   ``checkpoint.save`` folder to ``<save>.replaced-<time>``). ``checkpoint.resume=auto``
   continues the run that is there.
3. **Record.** The resolved configuration (``training.auto_settings``: the config the run
   reads) goes to ``<run_dir>/config.yaml`` (loadable with ``--config``), and everything
   rank 0 prints (stdout and stderr, warnings and tracebacks included) is also appended to
   ``<run_dir>/train.log``, one header line per start.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import socket
import sys
import time

from dpo_megatron.utils import ranks
from dpo_megatron.utils.files import write_text_atomic
from dpo_megatron.utils.run_layout import RunLayout

_CHECKPOINT_RE = re.compile(r"^iter_\d{7}")


class RunDirError(SystemExit):
    """The run folder cannot be used (held by another run, or holding a run this one would mix
    with). A ``SystemExit``: uncaught, rank 0 prints ``error: <message>`` and every rank exits
    with status 1, without a traceback per rank; ``dpo_megatron.train`` ends the ranks with
    ``dpo_megatron.utils.exits.fail`` instead (the launcher's one-line ending). ``str()`` is the
    message."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}" if ranks.is_rank0() else 1)
        self.message = message

    def __str__(self) -> str:
        return self.message


# ----------------------------------------------------------------------------------------------
# the lock


def _start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), to
    tell a live owner from a recycled pid; None where /proc is missing or the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _owner_record() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "start_ticks": _start_ticks(os.getpid()),
        "command": " ".join(sys.argv)[:500],
    }


def _describe_owner(owner: dict) -> str:
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}" + (
        f" ({owner['command']})" if owner.get("command") else ""
    )


class RunLock:
    """An exclusive, process-wide lock of one run folder (re-entrant within a process: a second
    :meth:`acquire` by the same process shares it, and it is released with the last
    :meth:`release`)."""

    _held: dict[str, RunLock] = {}

    def __init__(self, path: str, fd: int):
        self.path, self.fd, self.count = path, fd, 1
        self.stale_owner: dict | None = None

    @classmethod
    def acquire(cls, run_dir: str) -> RunLock:
        """Lock ``<run_dir>/run.lock``.

        Raises:
            RunDirError: another live run holds it (naming its owner).
        """
        os.makedirs(run_dir, exist_ok=True)
        path = RunLayout(run_dir).lock
        held = cls._held.get(path)
        if held is not None:
            held.count += 1
            return held
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            previous = _read_owner(fd)
            if not _flock(fd):  # a file system without flock: judge the recorded owner
                _check_owner_without_flock(previous, run_dir, path)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd)
        lock.stale_owner = previous
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_owner_record()) + "\n").encode(), 0)
        os.fsync(fd)
        cls._held[path] = lock
        return lock

    def release(self) -> None:
        """Release (when this was the last holder in the process). The file stays, empty: a
        lock file is never deleted, which would let two runs lock two different files."""
        self.count -= 1
        if self.count > 0 or self.fd < 0:
            return
        self._held.pop(self.path, None)
        try:
            os.ftruncate(self.fd, 0)
        except OSError:  # a read-only or full disk: the record of a released lock is stale
            pass
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


def _read_owner(fd: int) -> dict | None:
    data = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not data:
        return None
    try:
        owner = json.loads(data)
        return owner if isinstance(owner, dict) else {"command": data[:200]}
    except ValueError:
        return {"command": data[:200]}


def _flock(fd: int) -> bool:
    """Take the exclusive flock; True when taken, False where the file system has no flock.

    Raises:
        RunDirError: the lock is held by another process (the message is completed by the
            caller's owner record).
    """
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        owner = _read_owner(fd) or {}
        raise RunDirError(_in_use_message(os.path.dirname(_fd_path(fd)), owner)) from None
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise


def _probe_lock(run_dir: str) -> None:
    """Refuse, as :meth:`RunLock.acquire` would, a run folder whose lock a live run holds;
    takes nothing (the lock is tried and let go at once) and creates nothing.

    Raises:
        RunDirError: another live run holds the lock (naming its owner).
    """
    path = RunLayout(run_dir).lock
    if path in RunLock._held or not os.path.isfile(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # unreadable: the run's own acquire reports it
    try:
        previous = _read_owner(fd)
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            raise RunDirError(_in_use_message(run_dir, previous or {})) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            _check_owner_without_flock(previous, run_dir, path)
    finally:
        os.close(fd)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return RunLayout.LOCK


def _in_use_message(run_dir: str, owner: dict) -> str:
    return (
        f"run_dir {run_dir} is in use by another run ({_describe_owner(owner)}): one run per "
        f"run_dir. Wait for it to finish, stop it, or choose another run_dir"
    )


def _check_owner_without_flock(owner: dict | None, run_dir: str, path: str) -> None:
    if not owner or "pid" not in owner:
        return
    if owner.get("host") != socket.gethostname():
        raise RunDirError(
            _in_use_message(run_dir, owner) + f" (this file system has no locks, so whether "
            f"that run is still alive cannot be checked from here: if it is gone, delete {path})"
        )
    ticks = _start_ticks(int(owner["pid"]))
    if ticks is not None and ticks == owner.get("start_ticks"):
        raise RunDirError(_in_use_message(run_dir, owner))


# ----------------------------------------------------------------------------------------------
# one run per folder


def previous_run(run_dir: str, save_dir: str) -> list[str]:
    """What of an earlier run a folder holds (checkpoint folders, metrics records); empty when
    it holds nothing a new run would mix with."""
    found = []
    if os.path.isdir(save_dir):
        names = sorted(n for n in os.listdir(save_dir) if _CHECKPOINT_RE.match(n))
        if names:
            found.append(f"{len(names)} checkpoint folder(s) in {save_dir} (newest {names[-1]})")
    metrics = RunLayout(run_dir).metrics
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        with open(metrics, "rb") as f:
            records = sum(1 for line in f if line.strip())
        found.append(f"{RunLayout.METRICS} with {records} record(s)")
    if os.path.isfile(RunLayout(run_dir).online_state):
        found.append(f"an online run ({RunLayout(run_dir).online_state})")
    return found


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def move_aside(run_dir: str, save_dir: str) -> list[str]:
    """Move an earlier run's files out of the way, untouched: every entry of ``run_dir`` but the
    lock into ``<run_dir>.replaced-<time>/``, and a ``save_dir`` outside ``run_dir`` to
    ``<save_dir>.replaced-<time>``. Returns the new locations."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []

    def free_name(base: str) -> str:
        name, n = f"{base}.replaced-{stamp}", 1
        while os.path.exists(name):
            name, n = f"{base}.replaced-{stamp}-{n}", n + 1
        return name

    entries = [n for n in os.listdir(run_dir) if n != RunLayout.LOCK]
    if entries:
        dest = free_name(os.path.normpath(run_dir))
        os.makedirs(dest)
        for name in entries:
            os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
        moved.append(dest)
    if os.path.isdir(save_dir) and not _inside(save_dir, run_dir) and os.listdir(save_dir):
        dest = free_name(os.path.normpath(save_dir))
        os.rename(save_dir, dest)
        moved.append(dest)
    return moved


def check_no_mixing(cfg, run_dir: str, save_dir: str, move: bool = True) -> list[str]:
    """Refuse a fresh run over an earlier one (unless ``checkpoint.overwrite``, which moves the
    earlier one aside; ``move=False`` only checks). Returns the new locations of what was moved.

    Raises:
        RunDirError: naming what the folder holds and the three ways forward.
    """
    ckpt = cfg.checkpoint
    resume = ckpt.resume or "none"
    overwrite = ckpt.overwrite
    if overwrite and resume == "auto":
        raise RunDirError(
            "checkpoint.overwrite=true starts the run afresh, "
            "checkpoint.resume=auto continues it: choose one"
        )
    own = resume == "auto" or (
        resume != "none" and (_inside(resume, save_dir) or _inside(resume, run_dir))
    )
    if own:
        return []
    found = previous_run(run_dir, save_dir)
    if not found:
        return []
    if overwrite:
        return move_aside(run_dir, save_dir) if move else []
    started = (
        "a fresh run" if resume == "none" else f"a run resuming another run's checkpoint ({resume})"
    )
    raise RunDirError(
        f"run_dir {run_dir} already holds a run ({'; '.join(found)}): refusing to mix {started} "
        f"into it (nothing was changed). Continue that run with checkpoint.resume=auto, start "
        f"afresh with checkpoint.overwrite=true (the old run moves to "
        f"{os.path.normpath(run_dir)}.replaced-<time>), or choose another run_dir"
    )


def check_run_dir(cfg) -> None:
    """What :meth:`RunFolder.open` would refuse, checked beforehand by one process without
    torch, megatron-core or the data: a run folder in use by a live run, or a fresh run over an
    earlier one (re-running a finished run's command). Read-only: it takes no lock and moves
    nothing; the run's own :meth:`RunFolder.open` stays the authority. The launchers' pre-check
    and rank 0 of ``dpo_megatron.train`` call it first, so these refusals come in seconds,
    not after the model is built.

    Raises:
        RunDirError: with the message :meth:`RunFolder.open` would give.
    """
    layout = RunLayout.of(cfg)
    _probe_lock(layout.run_dir)
    check_no_mixing(cfg, layout.run_dir, layout.checkpoints, move=False)


# ----------------------------------------------------------------------------------------------
# config.yaml and train.log


class _Tee(io.TextIOBase):
    """A text stream writing to the console stream and the log file."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        try:
            self.log.write(text)
        except (OSError, ValueError):  # a full disk or a closed log must not stop the run
            pass
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        try:
            self.log.flush()
        except (OSError, ValueError):
            pass

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")


def _untee(stream):
    return stream.stream if isinstance(stream, _Tee) else stream


_LOG_START = "===="
"""The start of the line each start of a run writes into train.log (time, pid, host, command)."""


def log_started_by(log: str, pid: int) -> bool:
    """Whether the train.log ``log`` holds the start line of process ``pid`` (on this host): the
    log that process wrote to (the launcher asks, for rank 0)."""
    mark = f" pid {pid} on {socket.gethostname()}: "
    with open(log, encoding="utf-8", errors="replace") as f:
        return any(line.startswith(_LOG_START) and mark in line for line in f)


def write_config(cfg, run_dir: str) -> str:
    """The resolved config as YAML at ``<run_dir>/config.yaml`` (atomically); returns the path."""
    from omegaconf import OmegaConf

    path = RunLayout(run_dir).config
    write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)), fsync=False)
    return path


class RunFolder:
    """The run folder of a running run: its lock, config.yaml and train.log (rank 0 holds them;
    other ranks hold nothing). Build it with :meth:`open`; :meth:`close` at the end."""

    def __init__(self, layout: RunLayout, lock: RunLock | None = None, log=None):
        self.layout = layout
        self.run_dir, self.save_dir = layout.run_dir, layout.checkpoints
        self.lock, self.log = lock, log
        self._streams = None

    @classmethod
    def open(cls, cfg) -> RunFolder:
        """Lock the run folder, refuse mixing, start train.log and print where the run writes
        (``config.yaml`` comes once the run resolved its config: :meth:`record_config`);
        collective: every rank raises the same error.

        Raises:
            RunDirError: the folder is in use or holds another run (see the module docstring).
            StorageError: the folder cannot be written (a read-only or full disk, no
                permission): a fault of the run, naming the file.
        """
        from dpo_megatron.checkpointing.storage import StorageError, describe_storage_error

        layout = RunLayout.of(cfg)
        run_dir = layout.run_dir
        folder, error = cls(layout), None
        if ranks.is_rank0():
            try:
                folder._open_rank0(cfg)
            except RunDirError as e:
                error = (RunDirError, e.message)
            except OSError as e:
                error = (
                    StorageError,
                    f"cannot write run_dir {run_dir}: {describe_storage_error(e, run_dir)}; "
                    "nothing was started",
                )
            if error:
                folder.close()
        error = ranks.broadcast_from_rank0(error)
        if error:
            kind, message = error
            raise kind(message)
        return folder

    def _open_rank0(self, cfg) -> None:
        self.lock = RunLock.acquire(self.run_dir)
        moved = check_no_mixing(cfg, self.run_dir, self.save_dir)
        config_path = self.layout.config  # written by record_config, once the run resolved it
        self._start_log()
        stale = self.lock.stale_owner
        if stale:
            print(
                f"note: took over the lock of a run that is gone ({_describe_owner(stale)})",
                flush=True,
            )
        for path in moved:
            print(f"moved the previous run to {path} (checkpoint.overwrite=true)", flush=True)
        # An online run keeps no checkpoint of its own: each round's training has its folder.
        saves = self.layout.online_checkpoints if cfg.online.rounds else self.save_dir
        print(
            f"run_dir {self.run_dir} | checkpoints -> {saves} | config {config_path} "
            f"| log {self.layout.log}",
            flush=True,
        )

    def record_config(self, cfg) -> None:
        """Write the config the run resolved (``training.auto_settings``) to ``config.yaml``
        (rank 0, atomically; collective: every rank raises the same error).

        Raises:
            StorageError: the file cannot be written (a fault of the run, naming it).
        """
        from dpo_megatron.checkpointing.storage import StorageError, describe_storage_error

        error = None
        if ranks.is_rank0():
            try:
                write_config(cfg, self.run_dir)
            except OSError as e:
                path = self.layout.config
                error = f"cannot write {path}: {describe_storage_error(e, path)}"
        error = ranks.broadcast_from_rank0(error)
        if error:
            raise StorageError(error)

    def _start_log(self) -> None:
        self.log = open(self.layout.log, "a", buffering=1, encoding="utf-8")
        self.log.write(
            f"{_LOG_START} {time.strftime('%Y-%m-%d %H:%M:%S %z')} pid {os.getpid()} on "
            f"{socket.gethostname()}: {' '.join(sys.argv)}\n"
        )
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout = _Tee(_untee(sys.stdout), self.log)
        sys.stderr = _Tee(_untee(sys.stderr), self.log)

    def close(self) -> None:
        """Stop the log (restoring stdout / stderr) and release the lock."""
        if self._streams is not None:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            if isinstance(sys.stdout, _Tee) and sys.stdout.log is self.log:
                sys.stdout = self._streams[0]
            if isinstance(sys.stderr, _Tee) and sys.stderr.log is self.log:
                sys.stderr = self._streams[1]
            self._streams = None
        if self.log is not None:
            try:
                self.log.close()
            except OSError:  # its last lines met a full or read-only disk (as _Tee's writes)
                pass
            self.log = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
