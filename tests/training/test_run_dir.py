"""One run per run folder: the lock (held, stale, re-entrant, without flock), the refusal to mix
a fresh run into an old one (and overwrite moving it aside untouched), config.yaml and
train.log. No model: folders, processes and the config only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dpo_megatron.training import run_dir as run_dir_module
from dpo_megatron.training.run_dir import (
    RunDirError,
    RunFolder,
    RunLock,
    check_no_mixing,
    check_run_dir,
)
from dpo_megatron.utils.run_layout import RunLayout
from tests.checkpointing.faults import tree_digest

LOCK_FILE = RunLayout.LOCK

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(run_dir, *overrides):
    from dpo_megatron.config import load_config

    return load_config(
        None, [f"run_dir={run_dir}", "data.tokenizer=x", "data.path=unused.jsonl", *overrides]
    )


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of ``tmp_path / 'run'``; yields (run_dir, process)."""
    run_dir = tmp_path / "run"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from dpo_megatron.training.run_dir import RunLock
        RunLock.acquire({str(run_dir)!r})
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_second_run_is_refused_naming_the_owner(holder):
    run_dir, proc = holder
    with pytest.raises(
        RunDirError,
        match=rf"run_dir .*run is in use by another run \(pid "
        rf"{proc.pid} on .*started .*one run per run_dir",
    ):
        RunLock.acquire(str(run_dir))


def test_check_run_dir_refuses_what_open_would_and_changes_nothing(holder, tmp_path):
    """The pre-check of the launchers (no torch): a folder held by a live run, a fresh run over
    an earlier one; overwrite=true and resume=auto pass and nothing is moved or locked."""
    run_dir, proc = holder
    owner = (run_dir / LOCK_FILE).read_text()
    with pytest.raises(RunDirError, match=rf"is in use by another run \(pid {proc.pid} on "):
        check_run_dir(_config(run_dir))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    check_run_dir(_config(run_dir))  # a dead owner's lock is stale: no refusal
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="already holds a run .metrics.jsonl with 1 record"):
        check_run_dir(_config(run_dir))
    check_run_dir(_config(run_dir, "checkpoint.overwrite=true"))
    check_run_dir(_config(run_dir, "checkpoint.resume=auto"))
    check_run_dir(_config(tmp_path / "absent"))
    assert not (tmp_path / "absent").exists()
    assert (run_dir / LOCK_FILE).read_text() == owner  # never taken: the dead owner's record
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", LOCK_FILE]


def test_the_lock_of_a_killed_run_is_stale_and_taken_over(holder):
    run_dir, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = RunLock.acquire(str(run_dir))
    try:
        assert lock.stale_owner["pid"] == proc.pid
        assert f'"pid": {os.getpid()}' in (run_dir / LOCK_FILE).read_text()
    finally:
        lock.release()
    assert (run_dir / LOCK_FILE).read_text() == ""  # released: emptied, never deleted


def test_without_flock_the_owner_pid_and_start_time_decide(holder, monkeypatch):
    run_dir, proc = holder
    monkeypatch.setattr(run_dir_module, "_flock", lambda fd: False)  # e.g. Lustre without flock
    with pytest.raises(RunDirError, match=f"pid {proc.pid}"):
        RunLock.acquire(str(run_dir))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = RunLock.acquire(str(run_dir))
    assert lock.stale_owner["pid"] == proc.pid
    lock.release()


def test_the_lock_is_shared_within_one_process(tmp_path):
    first = RunLock.acquire(str(tmp_path))
    second = RunLock.acquire(str(tmp_path))
    assert second is first
    first.release()
    assert (tmp_path / LOCK_FILE).read_text() != ""  # still held by the second holder
    second.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""


@pytest.fixture
def old_run(tmp_path):
    run_dir = tmp_path / "run"
    for step in (2, 4):
        ckpt = run_dir / "checkpoints" / f"iter_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / "metadata.json").write_text("{}")
        (ckpt / "train_state.json").write_text(f'{{"step": {step}}}')
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events").write_text("x")
    return run_dir


def test_a_fresh_run_over_an_old_one_is_refused_and_nothing_changes(old_run):
    before = tree_digest(str(old_run))
    cfg = _config(old_run)
    with pytest.raises(RunDirError) as info:
        check_no_mixing(cfg, str(old_run), str(old_run / "checkpoints"))
    message = str(info.value)
    assert "already holds a run (2 checkpoint folder(s)" in message
    assert "newest iter_0000004" in message and "metrics.jsonl with 2 record(s)" in message
    assert "checkpoint.resume=auto" in message and "checkpoint.overwrite=true" in message
    assert tree_digest(str(old_run)) == before


def test_overwrite_moves_the_old_run_aside_untouched(old_run):
    before = tree_digest(str(old_run))
    moved = check_no_mixing(
        _config(old_run, "checkpoint.overwrite=true"), str(old_run), str(old_run / "checkpoints")
    )
    assert len(moved) == 1 and os.path.basename(moved[0]).startswith("run.replaced-")
    assert tree_digest(moved[0]) == before
    assert os.listdir(old_run) == []


def test_resume_decides_what_may_share_the_folder(old_run, tmp_path):
    save = str(old_run / "checkpoints")
    assert check_no_mixing(_config(old_run, "checkpoint.resume=auto"), str(old_run), save) == []
    own = f"checkpoint.resume={old_run}/checkpoints/iter_0000002"
    assert check_no_mixing(_config(old_run, own), str(old_run), save) == []
    with pytest.raises(RunDirError, match="resuming another run's checkpoint"):
        check_no_mixing(
            _config(old_run, f"checkpoint.resume={tmp_path}/elsewhere"), str(old_run), save
        )
    with pytest.raises(RunDirError, match="choose one"):
        check_no_mixing(
            _config(old_run, "checkpoint.resume=auto", "checkpoint.overwrite=true"),
            str(old_run),
            save,
        )
    empty = tmp_path / "empty"
    assert check_no_mixing(_config(empty), str(empty), str(empty / "checkpoints")) == []


def test_run_folder_writes_config_yaml_and_tees_rank0_output_to_train_log(tmp_path, capsys):
    from dpo_megatron.config import load_config

    run_dir = tmp_path / "run"
    cfg = _config(run_dir, "loss=dpo", "loss.beta=0.25", "checkpoint.export_hf=true")
    folder = RunFolder.open(cfg)
    folder.record_config(cfg)
    print("to stdout")
    print("to stderr", file=sys.stderr)
    folder.close()
    print("after close")
    log = (run_dir / "train.log").read_text()
    assert log.startswith("==== ") and f"pid {os.getpid()}" in log.splitlines()[0]
    assert f"checkpoints -> {run_dir}/checkpoints" in log
    assert "to stdout\n" in log and "to stderr\n" in log and "after close" not in log
    assert "to stdout" in capsys.readouterr().out  # the console still gets everything
    recorded = (run_dir / "config.yaml").read_text()
    assert "loss:\n  name: sigmoid\n" in recorded and "  export_hf: merged\n" in recorded
    again = load_config(str(run_dir / "config.yaml"))
    assert again.loss["beta"] == 0.25 and again.run_dir == str(run_dir)
    assert (run_dir / LOCK_FILE).read_text() == ""


def test_run_folder_refusal_is_a_clean_exit(old_run):
    with pytest.raises(RunDirError) as info:
        RunFolder.open(_config(old_run))
    assert info.value.code.startswith("error: run_dir ")  # printed once, by rank 0, no traceback
    assert not (old_run / "train.log").exists()  # refused before anything is written
    # Nothing is left held: a second attempt gets the same answer, not "in use".
    with pytest.raises(RunDirError, match="already holds a run"):
        RunFolder.open(_config(old_run))
