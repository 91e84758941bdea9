"""What every command does the same way: the bootstrap, the command line, the config, the ranks'
first checks, and one table from exception to the line and exit status that end a command.

A command is a module of :mod:`dpo_megatron.cli` with ``main(argv=None)`` (the whole command;
tests and programs call it) and, for ``python -m``, :func:`start` (the bootstrap, then ``main``).

How a command ends (:func:`stops`): an exception the table :data:`STOPS` names ends it with one
line, ``<prefix>: <message>``, and the row's status, no traceback; while the command line, the
config and the files it names are read and checked (``config=True``), any other ``ValueError``
or ``OSError`` is a ``config error`` (:data:`CONFIG_STOP`); every other exception keeps its
traceback. In the ranks of a job the line comes from rank 0 and every rank exits with the status
(:func:`dpo_megatron.utils.exits.fail`: 2 a mistake, 3 a fault of the run); on the launcher's
side (``check``, ``plan``) the process exits with the launcher's status for it
(:data:`~dpo_megatron.utils.exits.LAUNCHER_EXITS`: 1 for a mistake). A signal's status
(128 + N) is the run's own (:mod:`dpo_megatron.parallel.shutdown`).

Imports nothing heavy: a mistake in the config stops a command before torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from dpo_megatron.utils.exits import FAULT_EXIT, LAUNCHER_EXITS, USER_ERROR_EXIT, fail


class Stop(NamedTuple):
    """A row of the exit table."""

    errors: tuple[str, ...]
    """The exceptions it ends, by module and class name, matched along an exception's class
    hierarchy (naming them imports nothing: checkpointing's import torch)."""
    prefix: str
    """The line's first word(s): ``<prefix>: <the exception's message>``."""
    status: int
    """The exit status of each rank (:mod:`dpo_megatron.utils.exits`)."""


STOPS = (
    # A fault of the run every rank meets and reports: a checkpoint failing its checksums, a
    # full or read-only disk met by a save, the logs or the run folder, the NaN stop. Its
    # message names the file or the step and the last good checkpoint.
    Stop(
        (
            "dpo_megatron.checkpointing.integrity.CheckpointIntegrityError",
            "dpo_megatron.checkpointing.storage.StorageError",
            "dpo_megatron.parallel.shutdown.NonFiniteLossError",
        ),
        "error",
        FAULT_EXIT,
    ),
    # A user's mistake in what the command reads: a data file's row, a run folder in use or
    # holding another run, an online judge, the host allocator's setting.
    Stop(
        (
            "dpo_megatron.data.sources.DataError",
            "dpo_megatron.training.run_dir.RunDirError",
            "dpo_megatron.online.adapters.JudgeError",
            "dpo_megatron.parallel.host_malloc.HostMallocError",
        ),
        "error",
        USER_ERROR_EXIT,
    ),
)
"""Exception -> line and exit status, first row first (module docstring)."""

CONFIG_STOP = Stop(("builtins.ValueError", "builtins.OSError"), "config error", USER_ERROR_EXIT)
"""While the config is read and checked: any other mistake in it or in a file it names."""


def stop_for(
    error: BaseException, config: bool = False, mistakes: tuple[type, ...] = ()
) -> Stop | None:
    """The row that ends a command at ``error`` (``config``: while the config is read and
    checked; ``mistakes``: the command's own input errors, ``error:`` lines), or None: a
    traceback."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(error).__mro__}
    for stop in STOPS:
        if names.intersection(stop.errors):
            return stop
    if isinstance(error, mistakes):
        return Stop((), "error", USER_ERROR_EXIT)
    if config and names.intersection(CONFIG_STOP.errors):
        return CONFIG_STOP
    return None


@contextlib.contextmanager
def stops(
    *, config: bool = False, launcher: bool = False, mistakes: tuple[type, ...] = ()
) -> Iterator[None]:
    """End the command at an exception of the table (:func:`stop_for`) with its one line: in
    the ranks through :func:`~dpo_megatron.utils.exits.fail`, with ``launcher`` (the
    launchers' one-process commands) with the launcher's status.

    Raises:
        SystemExit: at a stop of the table; any other exception goes on.
    """
    try:
        yield
    except BaseException as error:
        stop = stop_for(error, config, mistakes)
        if stop is None:
            raise
        line = f"{stop.prefix}: {error}"
        if not launcher:
            fail(line, stop.status)
        if LAUNCHER_EXITS[stop.status] == 1:
            raise SystemExit(line) from None  # Python prints it on stderr; exit status 1
        raise SystemExit(LAUNCHER_EXITS[stop.status]) from None


def start(main: Callable[[], None], *, ranks: bool) -> None:
    """Run ``main`` as this process's main (``python -m``): with ``ranks`` (its processes are
    the engine's ranks) re-executed first with the engine's malloc tunables when they change
    anything (glibc reads them at start-up: ``parallel.host_malloc``; nothing heavy is imported
    yet), then what megatron-core's import needs (``compat.before_megatron_import``)."""
    if ranks:
        from dpo_megatron.parallel.host_malloc import restart_with_malloc_tunables

        restart_with_malloc_tunables()
    from dpo_megatron.compat import before_megatron_import

    before_megatron_import()
    main()


def description(doc: str) -> str:
    """The first paragraph of a command's module docstring ``doc`` as plain text on one line
    (its help's description): reST's double backquotes and ``:role:`` markup dropped."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", first).replace("``", "")


def parser(doc: str, prog: str) -> argparse.ArgumentParser:
    """A command's parser: ``prog`` as the command is run (``python -m dpo_megatron.train``: the
    usage line's first words), the first paragraph of its module docstring ``doc`` as the
    description (:func:`description`), ``--config FILE`` (repeatable: ``args.config`` is then a
    list of paths, or None) and dotted ``key=value`` overrides; the command adds its own
    options."""
    p = argparse.ArgumentParser(description=description(doc), prog=prog)
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="FILE",
        help="the run's YAML config (any path; the recipes are under configs/); several merge "
        "in order, a later file's keys over an earlier one's",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, options anywhere (``--config`` may follow the overrides); a usage
    error (an override without ``=``) ends the process with argparse's message."""
    args = p.parse_intermixed_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"overrides must look like key=value, got {bad}")
    return args


def world_size() -> int:
    """The ranks launched: torchrun's ``WORLD_SIZE`` (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_start(cfg, run_folder: bool = True) -> None:
    """What every rank checks before its heavy imports (torch, megatron-core), so that these
    stop in seconds: the layout against the ranks launched (1 alone: an external torchrun with
    the wrong ``--nproc-per-node``), then on rank 0 the run folder's refusals.

    Raises:
        ValueError: the layout does not fit the world size.
        RunDirError: the run folder is in use or holds another run (rank 0).
    """
    from dpo_megatron.utils.ranks import is_rank0

    cfg.parallel.validate(world_size())
    if run_folder and is_rank0():
        from dpo_megatron.training.run_dir import check_run_dir

        check_run_dir(cfg)


def run_in_ranks(work: Callable, *args, mistakes: tuple[type, ...] = (), **kwargs):
    """``work(*args, **kwargs)`` on this rank, ended by the table (:func:`stops`, with the
    command's own ``mistakes``); a collective broken by a peer's exit after this rank caught
    SIGINT / SIGTERM ends it with 128 + the signal and no traceback (a second Ctrl-C:
    :func:`~dpo_megatron.parallel.shutdown.broken_collectives_end_a_stopping_rank`); the process
    groups are torn down after it either way. Returns what ``work`` returns."""
    from dpo_megatron.parallel import destroy_distributed
    from dpo_megatron.parallel.shutdown import broken_collectives_end_a_stopping_rank

    try:
        with stops(mistakes=mistakes), broken_collectives_end_a_stopping_rank():
            return work(*args, **kwargs)
    finally:
        destroy_distributed()
