"""torch elastic's agent at a repeated signal: waits on for a repeated SIGTERM, stops the workers
at once for a second Ctrl-C.

On its first SIGTERM / SIGINT the agent (``torch/distributed/elastic/multiprocessing/api.py``,
torch 2.13: ``_terminate_process_handler`` raises ``SignalException``) forwards the signal to its
workers and waits for them up to its shutdown timeout before SIGKILL. Two things then go wrong:

* Under SLURM the agent gets SIGTERM more than once (slurmstepd signals every process of the
  step, srun's ``--kill-on-bad-exit`` / step termination repeats it): the second one raises again
  inside that wait, the agent exits with a traceback, and its workers, which die with it
  (:func:`dpo_megatron.parallel.shutdown.die_with_launcher`), are killed in the middle of the
  checkpoint they were asked to write.
* A second Ctrl-C raises inside that wait too, but the agent's ``run`` then shuts its workers
  down again from its ``finally`` (``torch/distributed/elastic/agent/server/api.py``): SIGTERM,
  which the workers ignore as a repeat, and another wait of the whole shutdown timeout, so the
  workers finish their step, evaluation and checkpoint after all. The workers, each in a session
  of its own, never see the Ctrl-C themselves.

:class:`RepeatedSignals` swaps the module's handler for one that raises on the first signal only
and ignores a SIGTERM after it; a SIGINT after it is first sent on to every worker's process
group (a worker that has a stop request pending takes SIGINT's default action: it ends at once,
its checkpoint writers with it), then raises, so the agent's second shutdown finds them gone.

Switched on by :mod:`dpo_megatron.cli.launch` around its call of torchrun's ``main``.
"""

from __future__ import annotations

import signal

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="torchrun_repeated_signal",
        why="torch elastic's agent aborts its wait for the workers at a second SIGTERM (SLURM "
        "sends more than one), so the workers die in the checkpoint of a preempted job; at a "
        "second Ctrl-C it waits for them again, so they save instead of stopping at once",
        versions={"torch": ">=2.13,<2.14"},
        switched_on="by dpo_megatron.cli.launch (the launcher scripts) around torchrun's main",
    )
)

MODULE = "torch.distributed.elastic.multiprocessing.api"
"""The module whose ``_terminate_process_handler`` the agent installs in ``PContext.start``."""


class RepeatedSignals:
    """Context manager: while installed, the agent's death-signal handler raises torch's
    ``SignalException`` for the first signal only; a later SIGTERM is ignored (one log line on
    stderr), a later SIGINT is sent on to the workers' process groups (this process's children)
    and raises, a later other signal raises as before. Does nothing on torch versions the patch
    was not written for (the handler's name or contract may have changed).

    Attributes:
        received: the first signal number seen while installed, or None.
        stopped_at_once: True once a repeated SIGINT was sent on to the workers.
    """

    def __init__(self):
        self.received: int | None = None
        self.stopped_at_once = False
        self._module = None
        self._original = None

    def handler(self, signum: int, frame) -> None:
        """The replacement for ``_terminate_process_handler`` (same signature)."""
        if self.received is not None and signum == signal.SIGTERM:
            import sys

            print(
                "launcher: SIGTERM again: still waiting for the ranks to save and stop",
                file=sys.stderr,
                flush=True,
            )
            return
        if self.received is None:
            self.received = signum
        elif signum == signal.SIGINT:
            self._interrupt_workers()
        self._original(signum, frame)

    def _interrupt_workers(self) -> None:
        """SIGINT to the process group of each child (torch elastic starts every worker as a
        session leader: its group is its pid), then SIGKILL to the groups still there after
        :data:`KILL_AFTER_S`. A rank's own handler ends it at a second SIGINT, but CPython runs a
        handler once for signals that arrive together: a rank busy in native code (a collective,
        a long kernel) when both Ctrl-C's forwarded SIGINTs reach it sees one signal, and would
        run on to its step's end. A killed rank prints no traceback and the checkpoints on disk
        stay whole (every save is atomic)."""
        import threading

        from dpo_megatron.utils.processes import child_pids

        self.stopped_at_once = True
        groups = list(child_pids())
        for pid in groups:
            _signal_group(pid, signal.SIGINT)

        def kill_the_rest() -> None:
            for pid in groups:
                if _group_alive(pid):
                    _signal_group(pid, signal.SIGKILL)

        timer = threading.Timer(KILL_AFTER_S, kill_the_rest)
        timer.daemon = True
        timer.start()

    def __enter__(self) -> RepeatedSignals:
        if PATCH.applies_to_installed():
            import importlib

            self._module = importlib.import_module(MODULE)
            self._original = self._module._terminate_process_handler
            self._module._terminate_process_handler = self.handler
        return self

    def __exit__(self, *exc) -> None:
        if self._module is not None:
            self._module._terminate_process_handler = self._original
            self._module = None


KILL_AFTER_S = 5.0
"""Seconds the workers have after a repeated SIGINT before their groups are killed."""


def _signal_group(pid: int, signum: int) -> None:
    import os

    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):  # gone, or not a group leader
        pass


def _group_alive(pid: int) -> bool:
    import os

    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
