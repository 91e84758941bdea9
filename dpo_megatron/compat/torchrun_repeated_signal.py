"""Keep torch elastic's agent waiting for its workers when a job's SIGTERM arrives twice.

On its first SIGTERM / SIGINT the agent (``torch/distributed/elastic/multiprocessing/api.py``,
torch 2.13: ``_terminate_process_handler`` raises ``SignalException``) forwards the signal to its
workers and waits for them up to its shutdown timeout before SIGKILL. Under SLURM the agent gets
SIGTERM more than once (slurmstepd signals every process of the step, srun's
``--kill-on-bad-exit`` / step termination repeats it): the second one raises again inside that
wait, the agent exits with a traceback, and its workers, which die with it
(:func:`dpo_megatron.parallel.shutdown.die_with_launcher`), are killed in the middle of the
checkpoint they were asked to write. :class:`RepeatedSigtermIgnored` swaps the module's handler
for one that raises on the first signal only and ignores a SIGTERM after it; a SIGINT after it
(a second Ctrl-C) still raises, so the agent stops at once as before.

Switched on by :mod:`dpo_megatron.launch` around its call of torchrun's ``main``.
"""

from __future__ import annotations

import signal
from typing import Optional

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="torchrun_repeated_signal",
        why="torch elastic's agent aborts its wait for the workers at a second SIGTERM (SLURM "
        "sends "
        "more than one), so the workers die in the checkpoint of a preempted job",
        versions={"torch": ">=2.13,<2.14"},
        switched_on="by dpo_megatron.launch (scripts/slurm/launch_node.sh) around torchrun's main",
    )
)

MODULE = "torch.distributed.elastic.multiprocessing.api"
"""The module whose ``_terminate_process_handler`` the agent installs in ``PContext.start``."""


class RepeatedSigtermIgnored:
    """Context manager: while installed, the agent's death-signal handler raises torch's
    ``SignalException`` for the first signal only; a later SIGTERM is ignored (one log line on
    stderr), a later SIGINT or other signal raises as before. Does nothing on torch versions the
    patch was not written for (the handler's name or contract may have changed).

    Attributes:
        received: the first signal number seen while installed, or None.
    """

    def __init__(self):
        self.received: Optional[int] = None
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
        self._original(signum, frame)

    def __enter__(self) -> "RepeatedSigtermIgnored":
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
