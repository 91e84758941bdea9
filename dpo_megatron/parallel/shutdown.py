"""How a run ends when it is asked to: Ctrl-C / SIGTERM, and the death of its launcher.

**Signals.** The first SIGINT or SIGTERM a rank receives only sets a flag (:class:`StopRequest`);
at the next step boundary every rank takes part in one all-reduce of the flags, so all ranks
learn at the same step that some rank was asked to stop, save a checkpoint of that step and
exit with status 128 + the signal number (130 for SIGINT, 143 for SIGTERM) and a message saying
what was saved (:class:`RunInterrupted`). After the first signal a SIGINT (a second Ctrl-C) ends
the rank at once, while further SIGTERMs are ignored: a rank under SLURM gets SIGTERM twice, from
slurmstepd (which signals every process of a job step: ``scancel --signal=TERM``, preemption, the
time limit) and again from torchrun, which forwards its own; honouring the second would kill the
rank in the middle of its checkpoint. torchrun sends SIGKILL after its ``--shutdown-timeout``
(``PET_SHUTDOWN_TIMEOUT``), SLURM after the cluster's KillWait, so the stop stays bounded.

The handler stays installed until :meth:`StopRequest.close` and decides about a repeat itself:
swapping in ``SIG_IGN`` / ``SIG_DFL`` from inside the handler would lose a signal that arrived
meanwhile, which CPython reports as ``OSError: Signal 15 ignored due to race condition`` (two
signals close together while the rank is busy in a save). The checkpoint writers a rank forks
during a save inherit the handler: there it does nothing (the rank decides; a writer dies with
its rank).

**The launcher's death.** torch elastic starts every worker in its own session, so a worker
outlives a torchrun (or ``scripts/pretrain_dpo.sh``) killed with SIGKILL and would go on
training and writing checkpoints. :func:`die_with_launcher` asks Linux to send the rank SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``), for processes started by torch elastic.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from dpo_megatron.utils import ranks
from dpo_megatron.utils.processes import die_with_parent


def die_with_launcher() -> bool:
    """Under torch elastic on Linux: have the kernel SIGKILL this process when its parent (the
    torchrun agent) dies. Returns True when set. Outside torchrun nothing is set (a single
    process started from a shell must not die with that shell's exit)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    return die_with_parent(signal.SIGKILL)


_received = 0  # the first SIGINT / SIGTERM this process caught (0: none), kept after close()


class NonFiniteLossError(RuntimeError):
    """Too many steps in a row had a NaN/Inf loss or gradient (``train.max_nonfinite_steps``);
    the message names the last checkpoint written."""


@contextlib.contextmanager
def broken_collectives_end_a_stopping_rank() -> Iterator[None]:
    """Around a rank's run: a ``RuntimeError`` (a collective broken by a peer's exit) met after
    this rank caught SIGINT / SIGTERM ends the process with 128 + that signal's number and no
    traceback. A second Ctrl-C kills each rank as torchrun's forwarded signal reaches it; a rank
    blocked in a gloo collective meanwhile gets ``Connection reset by peer`` before its own
    (pending) second signal is handled, and that is the stop the user asked for, not a fault.
    Without a signal caught, and for :class:`NonFiniteLossError`, the error propagates."""
    try:
        yield
    except RuntimeError as e:
        if not _received or isinstance(e, NonFiniteLossError):
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + _received)


class RunInterrupted(SystemExit):
    """The run stopped on SIGINT / SIGTERM after saving (or not saving, when the last update was
    skipped) a checkpoint. A ``SystemExit`` whose code is 128 + the signal number, so an
    uncaught one ends the process with that status; ``str()`` is the message."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, saved: bool):
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint, self.saved = signum, step, checkpoint, saved

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.saved:
            what = f"saved checkpoint {self.checkpoint}"
        elif self.checkpoint:
            what = f"step {self.step} not saved; last checkpoint {self.checkpoint}"
        else:
            what = f"step {self.step} not saved; no checkpoint"
        resume = "; continue with checkpoint.resume=auto" if self.checkpoint else ""
        return f"stopped by {name} after step {self.step}: {what}{resume}"


class StopRequest:
    """Catches SIGINT / SIGTERM in this rank and tells every rank at a step boundary (after the
    first signal: SIGINT takes the default action, SIGTERM is ignored).

    Handlers are installed only from the main thread (Python's rule); elsewhere
    :meth:`agreed` still takes part in the collective and reports the other ranks' signals.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a checkpoint writer forked by the rank: the rank decides
            return
        if self.signum:
            # Ctrl-C again: stop now, as SIGINT's default action. SIGTERM again: the same
            # request from another sender (see the module docstring), ignored.
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            return
        self.signum = signum
        global _received
        _received = _received or signum
        if not ranks.is_rank0():  # torchrun signals every rank: say it once
            return
        print(
            f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this "
            f"step, then stopping (Ctrl-C / SIGINT stops at once)",
            file=sys.stderr,
            flush=True,
        )

    def agreed(self) -> int:
        """The signal any rank received (0: none), the same on every rank (collective). Once
        agreed it is this rank's request too: a signal that reaches it later (torchrun stops
        the others when the first rank exits) counts as a repeat."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.signum
        from dpo_megatron.parallel.device import get_device

        flag = torch.tensor([self.signum], dtype=torch.int64, device=get_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = self.signum or int(flag.item())
        return int(flag.item())

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
