"""Signals and the launcher's death (no model): the first SIGTERM only sets the flag, a repeated
SIGTERM is ignored and a SIGINT then takes the default action (no signal lost to a handler swap),
and a rank started by torch elastic dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dpo_megatron.parallel.shutdown import RunInterrupted, StopRequest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_first_signal_sets_the_flag_a_repeated_sigterm_is_ignored(capsys):
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    try:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == signal.SIGTERM  # still alive: only the flag was set
        # SLURM's slurmstepd and torchrun both send SIGTERM: the repeat must not kill the rank
        # in its checkpoint
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == signal.SIGTERM
        assert capsys.readouterr().err.count("received SIGTERM: saving a checkpoint") == 1
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_two_signals_at_once_lose_none_to_a_handler_swap(monkeypatch, capsys):
    """SIGINT and SIGTERM arriving together while the rank is busy (both pending when its
    handlers run, as when torchrun's second shutdown sends SIGTERM during a save): the second
    is a repeat, handled without the ``OSError: Signal 15 ignored due to race condition`` that
    CPython reports when a handler is swapped for SIG_IGN with a signal of it pending."""
    import threading

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    stop = StopRequest()
    both = {signal.SIGINT, signal.SIGTERM}
    main = threading.main_thread().ident
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        signal.pthread_kill(main, signal.SIGINT)
        signal.pthread_kill(main, signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # both delivered, then handled
        assert stop.agreed() == signal.SIGINT  # the first; the SIGTERM was its repeat
        assert unraisable == []
        assert capsys.readouterr().err.count("received SIGINT: saving a checkpoint") == 1
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
        stop.close()


def test_a_second_sigint_stops_at_once_and_a_forked_writer_leaves_signals_to_its_rank():
    """In a process of its own (the second SIGINT ends it): a process it forks (as a checkpoint
    writer is) neither takes nor announces a SIGTERM it gets (its rank decides); after the
    first SIGINT the process runs on; the second SIGINT ends it by SIGINT's default action."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        from dpo_megatron.parallel.shutdown import StopRequest
        stop = StopRequest()
        writer = os.fork()
        if writer == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os._exit(7 if stop.signum == 0 else 8)
        print("writer", os.waitpid(writer, 0)[1] >> 8, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("alive", stop.signum, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        print("still alive", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["writer 7", f"alive {int(signal.SIGINT)}"], out.stderr
    assert out.returncode == -signal.SIGINT
    assert out.stderr.strip().splitlines() == [
        "received SIGINT: saving a checkpoint at the end of this step, then stopping "
        "(Ctrl-C / SIGINT stops at once)"
    ]


def test_run_interrupted_exits_with_128_plus_the_signal():
    saved = RunInterrupted(signal.SIGTERM, 4, "/r/checkpoints/iter_0000004", saved=True)
    assert saved.code == 143 and isinstance(saved, SystemExit)
    assert str(saved) == (
        "stopped by SIGTERM after step 4: saved checkpoint "
        "/r/checkpoints/iter_0000004; continue with checkpoint.resume=auto"
    )
    skipped = RunInterrupted(signal.SIGINT, 5, "/r/checkpoints/iter_0000004", saved=False)
    assert skipped.code == 130
    assert "step 5 not saved; last checkpoint /r/checkpoints/iter_0000004" in str(skipped)
    assert str(RunInterrupted(signal.SIGINT, 1, None, saved=False)).endswith(
        "step 1 not saved; no checkpoint"
    )


def _launcher(env_marker: bool) -> subprocess.Popen:
    """A stand-in launcher process that starts one 'rank' in its own session (as torch elastic
    does) and prints the rank's pid."""
    rank = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from dpo_megatron.parallel.shutdown import die_with_launcher
        print(die_with_launcher(), flush=True)
        time.sleep(600)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if env_marker:
        env["TORCHELASTIC_RUN_ID"] = "test"
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", {rank!r}], start_new_session=True,
                             stdout=subprocess.PIPE, text=True)
        print(p.pid, p.stdout.readline().strip(), flush=True)
        time.sleep(600)
    """)
    return subprocess.Popen(
        [sys.executable, "-c", launcher], env=env, stdout=subprocess.PIPE, text=True
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_a_rank_dies_within_seconds_of_its_launcher():
    launcher = _launcher(env_marker=True)
    pid, armed = launcher.stdout.readline().split()
    pid = int(pid)
    assert armed == "True" and _alive(pid)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the rank outlived its launcher"


def test_outside_torch_elastic_nothing_is_armed():
    launcher = _launcher(env_marker=False)
    pid, armed = launcher.stdout.readline().split()
    try:
        assert armed == "False"  # no parent-death signal outside torch elastic
    finally:
        os.kill(int(pid), signal.SIGKILL)
        launcher.kill()
        launcher.wait()


def test_a_collective_broken_by_a_stopped_peer_ends_a_signalled_rank_quietly(tmp_path):
    """Two gloo ranks both caught a first SIGINT; rank 0 then ends (a second Ctrl-C reached it
    first) while rank 1 waits in a broadcast, which fails with gloo's ``Connection reset by
    peer``: rank 1 ends with status 130 and no traceback. Without a signal caught the same
    broken broadcast is a traceback and status 1."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        import torch, torch.distributed as dist
        from dpo_megatron.parallel.shutdown import (
            StopRequest, broken_collectives_end_a_stopping_rank)
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg-" + sys.argv[1],
                                rank=rank, world_size=2)
        stop = StopRequest()
        if sys.argv[1] == "signalled":
            os.kill(os.getpid(), signal.SIGINT)
        dist.barrier()
        if rank == 0:
            time.sleep(1)
            os._exit(130)
        with broken_collectives_end_a_stopping_rank():
            dist.broadcast(torch.zeros(1), src=0)
        print("not reached", flush=True)
    """)

    def world(mode):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, mode],
                env={**os.environ, "RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        return [(p.wait(timeout=120), *p.communicate()) for p in procs]

    (status0, _, _), (status1, out1, err1) = world("signalled")
    assert (status0, status1) == (130, 130), err1
    assert out1 == "" and "Traceback" not in err1, err1
    (_, _, _), (status1, out1, err1) = world("unsignalled")
    assert status1 == 1 and "Traceback" in err1 and "RuntimeError" in err1, err1
