"""The launcher: ``python -m dpo_megatron.launch [torchrun options] -m ENTRY [args]`` (what
``scripts/pretrain_dpo.sh`` runs instead of ``torchrun``) is torchrun's own ``main`` in this
process (same options, signals and process tree) with one ending: when the first rank to fail
exited at a stop it reported (:func:`dpo_megatron.utils.exits.fail`: 2 a mistake, 3 a fault),
torchrun's ``ChildFailedError`` block and its failure log lines
(:mod:`dpo_megatron.compat.torchrun_failure_logs`) give way to one line pointing at the error
and the run's ``train.log``, and the launcher exits with
:data:`~dpo_megatron.utils.exits.LAUNCHER_EXITS` of it (1, 3). A SIGINT / SIGTERM, sent to the
launcher (forwarded by torchrun, which waits for the ranks to save) or to one rank alone, ends
with one line and 128 + the signal's number (a second Ctrl-C stops the ranks at once:
:mod:`dpo_megatron.compat.torchrun_repeated_signal`). Any other failure keeps torchrun's block
and status. The statuses, with examples: docs/RUNNING.md, "How a job ends".

The line points at ``<run_dir>/train.log`` only when this job's rank 0 wrote to it (the log
holds a start line with rank 0's process id): a job refused because another run holds the run
folder has not written there.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from dpo_megatron.utils.exits import LAUNCHER_EXITS, SIGNAL_EXITS


def _train_log(training_args: Sequence[str], rank0_pid: int | None = None) -> str:
    """Where rank 0's output also is: ``; rank 0's output is also in <run_dir>/train.log``, or
    "" when there is no such log (also when the config itself was the mistake); when
    ``rank0_pid`` is given and the log holds no start line of that process (another run's, or an
    earlier start's), it says so instead."""
    from dpo_megatron.cli.command import parse, parser
    from dpo_megatron.config import load_config

    try:
        args = parse(parser("the entry's command line"), list(training_args))
        cfg = load_config(args.config, args.overrides)
    except (ValueError, SystemExit, OSError):
        return ""
    from dpo_megatron.training.run_dir import log_started_by
    from dpo_megatron.utils.run_layout import RunLayout

    path = RunLayout(cfg.run_dir).log
    if not os.path.isfile(path):
        return ""
    try:
        ours = rank0_pid is None or log_started_by(path, rank0_pid)
    except OSError:  # unreadable: point at it as before
        ours = True
    if not ours:
        return f"; {path} holds no output of this job"
    return f"; rank 0's output is also in {path}"


def stopped_line(
    rank: int, failed: int, training_args: Sequence[str], rank0_pid: int | None = None
) -> str:
    """The launcher's one line after a rank's :func:`fail` (``failed``: ranks that ended;
    ``rank0_pid``: rank 0's process id, when known)."""
    others = f"; the other {failed - 1} rank(s) were stopped" if failed > 1 else ""
    where = _train_log(training_args, rank0_pid)
    return f"launcher: the job stopped at the line above (rank {rank}{others}){where}"


def signal_line(
    signum: int,
    training_args: Sequence[str],
    one_rank: bool = False,
    rank0_pid: int | None = None,
    at_once: bool = False,
) -> str:
    """The launcher's one line after the ranks stopped on SIGINT / SIGTERM: forwarded by
    torchrun, or (``one_rank``) sent to a rank directly; ``at_once``: a second Ctrl-C stopped
    them without saving."""
    name = signal.Signals(signum).name
    where = _train_log(training_args, rank0_pid)
    if at_once:
        return (
            f"launcher: the job stopped at once on a second {name} (forwarded to every rank; "
            f"the step in progress was not saved: continue from the last checkpoint with "
            f"checkpoint.resume=auto){where}"
        )
    sent = "sent to a rank, not to the launcher" if one_rank else "forwarded to every rank"
    return (
        f"launcher: the job stopped on {name} ({sent}; rank 0's line above says what was "
        f"saved){where}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """torchrun with the ending described in the module docstring."""
    from dpo_megatron.utils import collector

    collector.pause()  # for torch's imports; the agent then runs as long as the job
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun

    from dpo_megatron.compat.torchrun_failure_logs import HeldFailureLogs
    from dpo_megatron.compat.torchrun_repeated_signal import RepeatedSignals

    collector.resume_after_setup()
    argv = list(sys.argv[1:] if argv is None else argv)

    def training_args() -> list[str]:
        return get_args_parser().parse_args(argv).training_script_args

    with HeldFailureLogs() as held, RepeatedSignals() as signals:
        try:
            torchrun(argv)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            status = failure.exitcode
            if status not in LAUNCHER_EXITS and status not in SIGNAL_EXITS:
                raise
            held.drop()
            rank0 = e.failures.get(0)
            rank0_pid = rank0.pid if rank0 is not None else None
            if status in SIGNAL_EXITS:  # one rank was signalled: every rank saved and stopped
                line = signal_line(SIGNAL_EXITS[status], training_args(), True, rank0_pid)
            else:
                line = stopped_line(rank, len(e.failures), training_args(), rank0_pid)
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(LAUNCHER_EXITS.get(status, status)) from None
        except SignalException as e:
            # torchrun has sent the signal on to the ranks and waited for them (its shutdown
            # timeout, then SIGKILL): what they saved is in rank 0's line, not in a traceback.
            held.drop()
            line = signal_line(int(e.sigval), training_args(), at_once=signals.stopped_at_once)
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(128 + int(e.sigval)) from None


if __name__ == "__main__":
    main()
