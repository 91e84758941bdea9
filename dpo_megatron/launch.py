"""How a launched job ends when its ranks stop it on purpose: one line, not a traceback per rank
nor torchrun's.

Two halves, one contract (the exit statuses below):

* in the ranks, :func:`fail` ends a process at a stop whose message is the whole story: a config,
  data or run-folder mistake (:data:`USER_ERROR_EXIT`), or a fault of the run it found and
  reported (:data:`FAULT_EXIT`: a checkpoint failing its checksums, a full disk, too many NaN
  steps). Rank 0 prints the message as one line on stderr, every rank exits with the status.
  Under torch elastic the other ranks first wait for rank 0 to exit (torchrun then stops them):
  torch elastic terminates every worker as soon as one exits, so a rank that left first could
  otherwise cut rank 0 off before it printed the line. A rank stopped by SIGINT / SIGTERM exits
  with 128 + the signal's number after rank 0 printed what was saved
  (:mod:`dpo_megatron.training.shutdown`).
* the launcher, ``python -m dpo_megatron.launch [torchrun options] -m ENTRY [args]`` (what
  ``scripts/pretrain_dpo.sh`` runs instead of ``torchrun``), is torchrun's own ``main`` in this
  process (same options, signals and process tree), except for its ending: when the first rank
  to fail exited with one of those statuses, torchrun's ``ChildFailedError`` block (its own
  traceback and a table of exit codes, which say nothing more than that line) and its log lines
  about the failure (:mod:`dpo_megatron.compat.torchrun_failure_logs`) are replaced by one line
  pointing at the error and the run's ``train.log``, and the launcher exits with
  :data:`LAUNCHER_EXITS` of it (1 for a mistake, as the launchers' pre-check; 3 for a fault).
  A SIGINT / SIGTERM sent to the launcher (Ctrl-C, ``kill``, a scheduler) is forwarded to the
  ranks by torchrun, which waits for them to save and exit; instead of the ``SignalException``
  traceback torchrun then raises, the launcher prints one line and exits with 128 + the
  signal's number (a repeated SIGTERM, as Slurm's ``scancel`` sends to every process of the
  step, does not cut torchrun's wait short: :mod:`dpo_megatron.compat.torchrun_repeated_signal`).
  Any other failure (an exception's traceback, a rank killed) keeps
  torchrun's block and its exit status.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn, Optional, Sequence

USER_ERROR_EXIT = 2
"""Exit status of a rank stopped by a user's mistake it has reported (as for a command-line
usage error; Python's uncaught exceptions exit with 1, signals with 128 + N)."""
FAULT_EXIT = 3
"""Exit status of a rank stopped at a fault of the run it has reported: a checkpoint that
fails verification, a save that meets a full or read-only disk, ``train.max_nonfinite_steps``
NaN/Inf steps in a row. Distinct from a mistake's status, so that a script can tell "fix the
command" from "look at the run"."""
LAUNCHER_EXIT = 1
"""Exit status of the launcher for a user's mistake (the pre-check's status for the same
mistakes)."""
LAUNCHER_EXITS = {USER_ERROR_EXIT: LAUNCHER_EXIT, FAULT_EXIT: FAULT_EXIT}
"""A rank's reported stop -> the launcher's exit status."""
RANK0_GRACE_S = 20.0
"""How long the other ranks wait for rank 0 to print and exit before exiting anyway."""


def fail(message: str, status: int = USER_ERROR_EXIT) -> NoReturn:
    """End this rank at a user's mistake (or, with ``status=FAULT_EXIT``, a fault of the run):
    ``message`` on stderr from global rank 0 (every rank meets the same stop), exit status
    ``status``, no traceback. Under torch elastic another rank waits for rank 0 first, and
    prints the message itself if rank 0 is still running after :data:`RANK0_GRACE_S` (the stop
    was that rank's alone).

    Raises:
        SystemExit: always, with code ``status``.
    """
    rank0 = int(os.environ.get("RANK", "0")) == 0
    elastic = (
        bool(os.environ.get("TORCHELASTIC_RUN_ID")) and int(os.environ.get("WORLD_SIZE", "1")) > 1
    )
    waits = not rank0 and elastic
    if waits:
        _wait_for_rank0()  # returns only while rank 0 runs on
    if rank0 or waits:
        print(message, file=sys.stderr, flush=True)
    if rank0 and elastic:
        # Exit now, not after the process-group teardown and the interpreter's: the others
        # wait for this exit, and one that took longer than their grace (a busy machine)
        # would have them print the line again. Everything the run wrote is on disk already
        # (line-buffered log, complete checkpoints); the kernel releases the run's lock.
        sys.stdout.flush()
        os._exit(status)
    raise SystemExit(status)


def _wait_for_rank0() -> None:
    """Sleep until torch elastic terminates this rank (it does when rank 0 exits), at most
    :data:`RANK0_GRACE_S` (then the caller prints the message itself: the mistake was this
    rank's alone). The run's own SIGTERM handler (a checkpoint at the next step) is put back to
    the default first, so the termination is immediate."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread: the handler stays, the wait still ends
        pass
    time.sleep(RANK0_GRACE_S)


def _train_log(training_args: Sequence[str]) -> Optional[str]:
    """``<run_dir>/train.log`` of the entry's config when it exists, else None (also when the
    config itself was the mistake)."""
    from dpo_megatron.config import load_config, parse_args

    try:
        cfg = load_config(*parse_args(list(training_args)))
    except (ValueError, SystemExit, OSError):
        return None
    from dpo_megatron.training.run_dir import LOG_FILE

    path = os.path.join(cfg.run_dir, LOG_FILE)
    return path if os.path.isfile(path) else None


def stopped_line(rank: int, failed: int, training_args: Sequence[str]) -> str:
    """The launcher's one line after a rank's :func:`fail` (``failed``: ranks that ended)."""
    others = f"; the other {failed - 1} rank(s) were stopped" if failed > 1 else ""
    log = _train_log(training_args)
    where = f"; rank 0's output is also in {log}" if log else ""
    return f"launcher: the job stopped at the line above (rank {rank}{others}){where}"


def signal_line(signum: int, training_args: Sequence[str]) -> str:
    """The launcher's one line after it forwarded SIGINT / SIGTERM to the ranks and they ended."""
    log = _train_log(training_args)
    where = f"; rank 0's output is also in {log}" if log else ""
    return (
        f"launcher: the job stopped on {signal.Signals(signum).name} (forwarded to every "
        f"rank; rank 0's line above says what was saved){where}"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """torchrun with the ending described in the module docstring."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    from dpo_megatron.compat.torchrun_failure_logs import HeldFailureLogs
    from dpo_megatron.compat.torchrun_repeated_signal import RepeatedSigtermIgnored

    argv = list(sys.argv[1:] if argv is None else argv)

    def training_args() -> list[str]:
        return get_args_parser().parse_args(argv).training_script_args

    with HeldFailureLogs() as held, RepeatedSigtermIgnored():
        try:
            torchrun(argv)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.exitcode not in LAUNCHER_EXITS:
                raise
            held.drop()
            print(stopped_line(rank, len(e.failures), training_args()), file=sys.stderr, flush=True)
            raise SystemExit(LAUNCHER_EXITS[failure.exitcode]) from None
        except SignalException as e:
            # torchrun has sent the signal on to the ranks and waited for them (its shutdown
            # timeout, then SIGKILL): what they saved is in rank 0's line, not in a traceback.
            held.drop()
            print(signal_line(int(e.sigval), training_args()), file=sys.stderr, flush=True)
            raise SystemExit(128 + int(e.sigval)) from None


if __name__ == "__main__":
    main()
