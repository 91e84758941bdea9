"""The launcher's one-line endings (:mod:`dpo_megatron.cli.launch`): after a rank's stop
(:func:`dpo_megatron.utils.exits.fail`) and after SIGINT / SIGTERM.

A line points at ``<run_dir>/train.log`` only when this job's rank 0 wrote to it (the log holds a
start line with rank 0's process id): a job refused because another run holds the run folder has
not written there.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
from collections.abc import Sequence


def _train_log(training_args: Sequence[str], rank0_pid: int | None = None) -> str:
    """Where rank 0's output also is: ``; rank 0's output is also in <run_dir>/train.log``, or
    "" when there is no such log (also when the config itself was the mistake); when
    ``rank0_pid`` is given and the log holds no start line of that process (another run's, or an
    earlier start's), it says so instead."""
    from dpo_megatron.cli.command import parse, parser
    from dpo_megatron.config import load_config

    try:
        # quietly: an entry with flags of its own (a converter) is no config command, and
        # argparse would print its usage and "unrecognized arguments" under the stop's line
        with contextlib.redirect_stderr(io.StringIO()):
            args = parse(parser("the entry's command line", "the entry"), list(training_args))
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
