"""TensorBoard's event-writer thread leaves a failed write to its writer instead of printing it.

``torch.utils.tensorboard.SummaryWriter`` writes through tensorboard's ``EventFileWriter``
(``tensorboard/summary/writer/event_file_writer.py``, tensorboard 2.21), which appends every
event from a thread of its own (``_AsyncWriterThread``). When an append fails (a full or
read-only disk) the thread keeps the exception for the writer, which raises it in the caller's
thread at its next ``add_event`` / ``flush``, and re-raises it as well, so Python's
``threading.excepthook`` prints a traceback on stderr at that moment: a stray traceback beside
the run's own one-line report of the same fault
(:class:`~dpo_megatron.training.metrics_log.MetricsLogger`). :func:`quiet_writer_thread_errors`
installs a ``threading.excepthook`` that drops exactly those (an ``OSError`` in that thread
class) and hands every other exception to the hook that was there before.

Switched on by the metrics logger when it opens a TensorBoard writer.
"""

from __future__ import annotations

import threading

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="tensorboard_writer_thread",
        why="tensorboard's event-writer thread prints the traceback of a failed append (a full "
        "or read-only disk) although the writer raises the same error to its caller",
        versions={"tensorboard": "==2.21.*"},
        switched_on="by the metrics logger when it opens a TensorBoard writer",
    )
)

MODULE = "tensorboard.summary.writer.event_file_writer"
"""The module of the writer thread's class, ``_AsyncWriterThread``."""

_installed: list = []
"""The hook that was there before ours, once ours is installed."""


def quiet_writer_thread_errors() -> bool:
    """Install the filtering ``threading.excepthook`` (idempotent); returns True when installed
    (False on tensorboard versions the patch was not written for)."""
    if _installed:
        return True
    if not PATCH.applies_to_installed():
        return False
    import importlib

    writer_thread = importlib.import_module(MODULE)._AsyncWriterThread
    previous = threading.excepthook

    def excepthook(args) -> None:
        if isinstance(args.thread, writer_thread) and issubclass(args.exc_type, OSError):
            return  # raised again by the writer in its caller's thread
        previous(args)

    threading.excepthook = excepthook
    _installed.append(previous)
    return True
