"""Hold back torch elastic's log lines about a failed worker until the launcher knows why it failed.

When a worker exits non-zero, torch elastic's process context (``torch/distributed/elastic/
multiprocessing/api.py``, torch 2.13) logs ``Sending process P closing signal SIGTERM`` for every
other worker, then ``failed (exitcode: N) local_rank: R (pid: P) of binary: B``, before the
launcher raises its ``ChildFailedError``. When the worker stopped at a user's mistake (it printed
one ``error:`` line and exited with ``dpo_megatron.utils.exits.USER_ERROR_EXIT``) those lines only
repeat its exit status around that line; for a crash they belong in front of torchrun's failure
block. The first line is also logged when torchrun forwards a SIGINT / SIGTERM it received to
its workers, which then save and end with their own line. :class:`HeldFailureLogs` is a
``logging.Filter`` on that logger which keeps exactly these
two records aside; the launcher then drops them (a reported stop, a forwarded signal) or releases
them, in order (a crash, anything else). Every other record of the logger passes at once.

Switched on by :mod:`dpo_megatron.cli.launch` only, around its call of torchrun's ``main``. If torch
renames the logger or rewords the messages, nothing is held and the lines simply print.
"""

from __future__ import annotations

import logging

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="torchrun_failure_logs",
        why="torch elastic logs a closing-signal and a 'failed (exitcode: N)' line around a worker "
        "that stopped at a user's mistake, after that mistake's one error line",
        versions={"torch": ">=2.13,<2.14"},
        switched_on="by dpo_megatron.cli.launch (scripts/pretrain_dpo.sh) around torchrun's main",
        off_on_other_versions=False,  # a filter of unknown messages holds nothing
    )
)

HELD: dict[str, tuple[str, ...]] = {
    # torch elastic's process context (``get_logger()`` names a logger after its module)
    "torch.distributed.elastic.multiprocessing.api": (
        "Sending process %s closing signal %s",
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
    ),
    # its agent, when torchrun itself gets SIGINT / SIGTERM and forwards it
    "torch.distributed.elastic.agent.server.api": (
        "Received %s death signal, shutting down workers",
    ),
}
"""Logger -> the unformatted messages (``LogRecord.msg``) held back on it."""


class HeldFailureLogs(logging.Filter):
    """Keeps the records of :data:`HELD` while installed (one filter on each of its loggers).

    Use as a context manager (installs the filter; on exit releases whatever is still held), and
    call :meth:`drop` to discard the held records instead.
    """

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._loggers = [logging.getLogger(name) for name in HELD]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in HELD.get(record.name, ()):
            self.records.append(record)
            return False
        return True

    def __enter__(self) -> HeldFailureLogs:
        for logger in self._loggers:
            logger.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Remove the filter and emit the held records, in the order they were logged."""
        self._remove()
        records, self.records = self.records, []
        for record in records:
            logging.getLogger(record.name).handle(record)

    def drop(self) -> None:
        """Remove the filter and discard the held records."""
        self._remove()
        self.records = []

    def _remove(self) -> None:
        for logger in self._loggers:
            logger.removeFilter(self)
