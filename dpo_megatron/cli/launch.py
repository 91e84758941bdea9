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

The lines themselves: :mod:`dpo_megatron.cli.launch_lines`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dpo_megatron.cli.launch_lines import signal_line, stopped_line
from dpo_megatron.utils.exits import LAUNCHER_EXITS, SIGNAL_EXITS


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
