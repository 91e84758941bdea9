"""How a rank ends at a stop it has reported: one line from rank 0 and an exit status, no
traceback (the rank half of the launcher's contract, :mod:`dpo_megatron.cli.launch`).

A leaf module: the allocator setup, the entry point and the launcher all end through
:func:`fail`, and none of them has to import another to do so.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn

from dpo_megatron.utils.ranks import rank

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
SIGNAL_EXITS = {128 + signal.SIGINT: signal.SIGINT, 128 + signal.SIGTERM: signal.SIGTERM}
"""A rank's exit status after it stopped on SIGINT / SIGTERM and rank 0 said what was saved
(``parallel.shutdown.RunInterrupted``) -> the signal; the launcher exits with the same status.
A rank killed by a signal has no exit status of its own (torchrun reports -N)."""
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
    rank0 = rank() == 0
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
