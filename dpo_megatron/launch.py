"""How a launched job ends at a user's mistake: one line, not a traceback per rank nor torchrun's.

Two halves, one contract (:data:`USER_ERROR_EXIT`):

* in the ranks, :func:`fail` ends a process at a config, data or run-folder mistake whose
  message is the whole story: rank 0 prints it as one line on stderr, every rank exits with
  :data:`USER_ERROR_EXIT`. Under torch elastic the other ranks first wait for rank 0 to exit
  (torchrun then stops them): torch elastic terminates every worker as soon as one exits, so a
  rank that left first could otherwise cut rank 0 off before it printed the line.
* the launcher, ``python -m dpo_megatron.launch [torchrun options] -m ENTRY [args]`` (what
  ``scripts/pretrain_dpo.sh`` runs instead of ``torchrun``), is torchrun's own ``main`` in this
  process (same options, signals and process tree), except for its ending: when the first rank
  to fail exited with :data:`USER_ERROR_EXIT`, torchrun's ``ChildFailedError`` block (its own
  traceback and a table of exit codes, which say nothing more than that line) and its log lines
  about the failure (:mod:`dpo_megatron.compat.torchrun_failure_logs`) are replaced by one line
  pointing at the error and the run's ``train.log``, and the launcher exits with status 1, as the
  launchers' pre-check does for the mistakes it catches. Any other failure (an exception's
  traceback, a rank killed) keeps torchrun's block and its exit status. When the launcher itself
  is asked to stop (SIGTERM from ``scancel``, SLURM preemption or a time limit; SIGINT), it
  forwards the signal to the ranks, waits for them to save at the end of their step (a repeated
  SIGTERM does not cut that wait short: :mod:`dpo_megatron.compat.torchrun_repeated_signal`), then
  prints one line and exits with 128 + the signal number instead of torchrun's traceback.
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
LAUNCHER_EXIT = 1
"""Exit status of the launcher for such a job (the pre-check's status for the same mistakes)."""
RANK0_GRACE_S = 10.0
"""How long the other ranks wait for rank 0 to print and exit before exiting anyway."""


def fail(message: str) -> NoReturn:
    """End this rank at a user's mistake: ``message`` on stderr from global rank 0 (every rank
    meets the same mistake), exit status :data:`USER_ERROR_EXIT`, no traceback. Under torch
    elastic another rank waits for rank 0 first, and prints the message itself if rank 0 is
    still running after :data:`RANK0_GRACE_S` (the mistake was that rank's alone).

    Raises:
        SystemExit: always, with code :data:`USER_ERROR_EXIT`.
    """
    rank0 = int(os.environ.get("RANK", "0")) == 0
    waits = not rank0 and bool(os.environ.get("TORCHELASTIC_RUN_ID")) and \
        int(os.environ.get("WORLD_SIZE", "1")) > 1
    if waits:
        _wait_for_rank0()  # returns only while rank 0 runs on
    if rank0 or waits:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT)


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


def signal_line(signum: int) -> str:
    """The launcher's one line after it was stopped by ``signum`` (its exit status is 128 +
    ``signum``; the ranks print what they saved)."""
    return (f"launcher: stopped by {signal.Signals(signum).name}: the ranks were asked to save a "
            f"checkpoint at the end of their step and stop (their lines above say what was "
            f"saved)")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """torchrun with the ending described in the module docstring."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    from dpo_megatron.compat.torchrun_failure_logs import HeldFailureLogs
    from dpo_megatron.compat.torchrun_repeated_signal import RepeatedSigtermIgnored

    argv = list(sys.argv[1:] if argv is None else argv)
    with HeldFailureLogs() as held, RepeatedSigtermIgnored():
        try:
            torchrun(argv)
        except SignalException as e:
            print(signal_line(e.sigval), file=sys.stderr, flush=True)
            raise SystemExit(128 + int(e.sigval)) from None
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.exitcode != USER_ERROR_EXIT:
                raise
            held.drop()
            training_args = get_args_parser().parse_args(argv).training_script_args
            print(stopped_line(rank, len(e.failures), training_args), file=sys.stderr,
                  flush=True)
            raise SystemExit(LAUNCHER_EXIT) from None


if __name__ == "__main__":
    main()
