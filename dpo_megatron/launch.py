"""How a launched job ends when its ranks stop it on purpose: one line, not a traceback per rank
nor torchrun's.

Two halves, one contract (the exit statuses below):

* in the ranks, :func:`dpo_megatron.utils.exits.fail` ends a process at a stop whose message is
  the whole story: a config, data or run-folder mistake (:data:`USER_ERROR_EXIT`), or a fault of
  the run it found and reported (:data:`FAULT_EXIT`: a checkpoint failing its checksums, a full
  disk, too many NaN steps). Rank 0 prints the message as one line on stderr, every rank exits
  with the status. Under torch elastic the other ranks first wait for rank 0 to exit (torchrun
  then stops them): torch elastic terminates every worker as soon as one exits, so a rank that
  left first could otherwise cut rank 0 off before it printed the line. A rank stopped by SIGINT /
  SIGTERM exits with 128 + the signal's number after rank 0 printed what was saved
  (:mod:`dpo_megatron.parallel.shutdown`).
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
from typing import Optional, Sequence

from dpo_megatron.utils.exits import LAUNCHER_EXITS


def _train_log(training_args: Sequence[str]) -> Optional[str]:
    """``<run_dir>/train.log`` of the entry's config when it exists, else None (also when the
    config itself was the mistake)."""
    from dpo_megatron.config import load_config, parse_args

    try:
        cfg = load_config(*parse_args(list(training_args)))
    except (ValueError, SystemExit, OSError):
        return None
    from dpo_megatron.utils.run_layout import RunLayout

    path = RunLayout(cfg.run_dir).log
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
    from dpo_megatron.utils import collector

    collector.pause()  # for torch's imports; the agent then runs as long as the job
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    from dpo_megatron.compat.torchrun_failure_logs import HeldFailureLogs
    from dpo_megatron.compat.torchrun_repeated_signal import RepeatedSigtermIgnored

    collector.resume_after_setup()
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
