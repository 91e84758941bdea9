"""compat.torchrun_repeated_signal: torch elastic's agent raises at its first death signal only;
a repeated SIGTERM (SLURM sends more than one) no longer aborts its wait for the workers' save,
and a second Ctrl-C reaches the workers (in sessions of their own) before the agent stops."""

import importlib
import signal
import subprocess

import pytest

from dpo_megatron.compat.torchrun_repeated_signal import MODULE, RepeatedSignals
from dpo_megatron.utils.processes import child_pids


def _worker(argv):
    """A stand-in worker in a session of its own, as torch elastic starts them, with SIGINT's
    default action: a test run started in the background (``nohup``, ``&``) ignores SIGINT, and
    a child would inherit that."""
    return subprocess.Popen(
        argv,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_only_the_first_signal_raises_and_a_second_sigint_interrupts_the_workers(
    capsys, monkeypatch
):
    api = importlib.import_module(MODULE)
    original = api._terminate_process_handler
    with pytest.raises(api.SignalException):  # unpatched: every SIGTERM raises
        original(signal.SIGTERM, None)
    # a stand-in worker: a session of its own, as torch elastic starts them
    worker = _worker(["sleep", "600"])
    try:
        assert worker.pid in child_pids()
        # only this worker: the test process may have other children
        monkeypatch.setattr("dpo_megatron.utils.processes.child_pids", lambda pid=0: [worker.pid])
        with RepeatedSignals() as patch:
            handler = api._terminate_process_handler
            assert handler is not original
            with pytest.raises(api.SignalException) as first:
                handler(signal.SIGTERM, None)
            assert first.value.sigval == signal.SIGTERM and patch.received == signal.SIGTERM
            assert handler(signal.SIGTERM, None) is None  # the repeat: ignored
            assert "SIGTERM again: still waiting for the ranks" in capsys.readouterr().err
            assert worker.poll() is None and not patch.stopped_at_once
            with pytest.raises(api.SignalException) as second:  # a second Ctrl-C stops at once
                handler(signal.SIGINT, None)
            assert second.value.sigval == signal.SIGINT and patch.stopped_at_once
            assert worker.wait(timeout=10) == -signal.SIGINT  # sent on to the worker's group
        assert api._terminate_process_handler is original
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_still_there_after_the_repeated_sigint_is_killed(monkeypatch):
    """A worker that runs on after the second Ctrl-C's SIGINT (its two forwarded SIGINTs seen as
    one while it was busy in native code: here it ignores SIGINT) is killed after
    ``KILL_AFTER_S``; one that stops at the SIGINT is not signalled again."""
    import sys
    import time

    from dpo_megatron.compat import torchrun_repeated_signal as repeated

    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    stubborn = _worker([sys.executable, "-c", code])
    polite = _worker([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(1.0)  # both running their sleep
        monkeypatch.setattr(repeated, "KILL_AFTER_S", 0.5)
        monkeypatch.setattr(
            "dpo_megatron.utils.processes.child_pids", lambda: [stubborn.pid, polite.pid]
        )
        signals = repeated.RepeatedSignals()
        signals._interrupt_workers()
        assert signals.stopped_at_once
        assert polite.wait(timeout=10) == -signal.SIGINT
        assert stubborn.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (stubborn, polite):
            p.kill()
