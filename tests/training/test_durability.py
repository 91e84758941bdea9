"""Fault injection on whole runs (tiny model, at most 2 ranks): corrupted shards, planted payloads,
a fresh or a second run in a used run_dir, SIGTERM on one rank, a full disk, NaN steps, and
``kill -9`` of the launcher at random moments followed by a resume that must match a run that
was never interrupted, step for step and file for file.

Each case states the fault, then asserts the new behaviour: a clear error naming the file or
path, a fall-back with a warning, or an exact continuation.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from dpo_megatron.checkpointing.integrity import verify_checkpoint
from tests.checkpointing.faults import flip_bytes, plant_in_dcp_item, tree_digest
from tests.checkpointing.test_storage import ext4_turning_read_only, small_tmpfs
from tests.multirank import process_context, run_ranks
from tests.scripts import launcher_env
from tests.training.test_lifecycle import (
    _train,
    read_metrics,
    run_train,
    tiny_overrides,
    write_fixture,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("tokens_per_s", "step_time_s", "memory/peak_gib", "memory/current_gib")
"""Metrics that measure the machine (time; the process's memory, which a resumed process does
not share with an uninterrupted one): everything else must be bit-identical after a resume."""


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("durability_data"))


def exact_metrics(run_dir) -> dict:
    """metrics.jsonl of a run, by (split, step), without the timing fields."""
    out = {}
    for split in ("train", "eval"):
        for step, record in read_metrics(run_dir, split).items():
            out[(split, step)] = {k: v for k, v in record.items() if k not in TIMING}
    return out


def checkpoint_files(ckpt_dir) -> dict:
    """What must be bit-identical between two checkpoints of the same step: every file's bytes,
    except torch DCP's ``.metadata`` (it records the save's random id and the folder's path:
    compared unpickled, without those) and ``train_state.json`` (compared without the run id),
    and the manifest (it lists those two)."""
    out = {}
    for name, digest in tree_digest(str(ckpt_dir)).items():
        if name in (".metadata", "train_state.json", "manifest.json"):
            continue
        out[name] = digest
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # written by the test's own runs
    out[".metadata"] = (
        sorted(map(repr, metadata.state_dict_metadata.items())),
        sorted(map(repr, metadata.storage_data.items())),
    )
    state = json.loads(Path(ckpt_dir, "train_state.json").read_text())
    state.pop("run_id")
    out["train_state.json"] = state
    return out


def _failure(fn, **kwargs) -> str:
    """The error text of a run expected to fail."""
    with pytest.raises(RuntimeError) as info:
        run_ranks(fn, **kwargs)
    return str(info.value)


# ----------------------------------------------------------------------------------------------
# full disk


def _train_filling_the_disk(run_dir, data_file, tok_dir, overrides, estimate):
    """train() where, right after the first checkpoint, the disk fills up to half a checkpoint
    of free space. Without ``estimate`` the checkpoint writer gets no free-space estimate, so
    the writes themselves run into the full disk (the pre-flight check normally catches it)."""
    import torch.distributed as dist

    from dpo_megatron.checkpointing import storage, training_checkpoint
    from dpo_megatron.checkpointing.run_checkpoint import Checkpointer

    if not estimate:
        training_checkpoint.sharded_bytes = lambda state: 0
    real_save = Checkpointer.save

    def save(self, counters):
        path = real_save(self, counters)
        if counters.step == 1 and dist.get_rank() == 0:
            size = sum(s for s, _ in tree_digest(path).values())
            filler = os.path.join(os.path.dirname(run_dir), "filler")
            with open(filler, "wb") as f:
                f.write(b"\0" * max(storage.free_bytes(filler) - size // 2, 0))
        dist.barrier()
        return path

    Checkpointer.save = save
    return _train(run_dir, data_file, tok_dir, overrides)


@pytest.mark.parametrize("estimate", [True, False], ids=["preflight", "mid_write"])
def test_full_disk_is_named_removes_its_tmp_and_the_previous_checkpoint_loads(
    tmp_path, fixture_files, estimate
):
    """2 ranks on a 16 MB tmpfs that is full but for half a checkpoint when step 2 saves."""
    data_file, tok_dir = fixture_files
    common = [
        "train.train_iters=2",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last_n=0",
        "parallel.tensor_model_parallel_size=2",
    ]
    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        run_dir = disk / "run"
        error = _failure(
            _train_filling_the_disk,
            world_size=2,
            run_dir=str(run_dir),
            data_file=data_file,
            tok_dir=tok_dir,
            overrides=common,
            estimate=estimate,
        )
        ckpts = run_dir / "checkpoints"
        assert f"CheckpointSaveError: saving checkpoint {ckpts / 'iter_0000002'} failed" in error
        assert "no space left on device" in error
        assert (
            ("it needs about" in error) if estimate else "no space left on device writing " in error
        ), error[-2000:]
        assert "Removed iter_0000002.tmp" in error
        assert sorted(os.listdir(ckpts)) == ["iter_0000001"]  # the .tmp is gone
        os.remove(disk / "filler")
        # The previous checkpoint verifies and loads (resume=auto, nothing left to train).
        run_train(
            run_dir,
            data_file,
            tok_dir,
            "train.train_iters=1",
            "checkpoint.resume=auto",
            *common[1:],
            world_size=2,
            tp=2,
        )
        log = (run_dir / "train.log").read_text()
        assert f"verified {ckpts / 'iter_0000001'}" in log and "nothing to do" in log


# ----------------------------------------------------------------------------------------------
# corrupted and planted checkpoints

FOUR_STEPS = ["train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last_n=0"]


def _convert(load, save):
    """The HF exporter in this rank; its stop (``utils.exits.fail``: one line on stderr, exit
    2) as a RuntimeError ``exit STATUS: LINE`` for the test to read."""
    import contextlib
    import io
    import runpy

    converter = runpy.run_path(
        str(ROOT / "scripts" / "convert_megatron_to_hf.py"), run_name="converter"
    )
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            converter["main"](["--load", load, "--save", save])
    except SystemExit as stop:
        raise RuntimeError(f"exit {stop.code}: {err.getvalue()}") from None


def test_a_corrupted_shard_is_named_everywhere_and_auto_falls_back(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    base = tmp_path / "base"
    run_train(base, data_file, tok_dir, *FOUR_STEPS)
    shard = sorted(p.name for p in (base / "checkpoints" / "iter_0000004").glob("*.distcp"))[0]
    # Each save reports its cost, checksums included (the manifest's price).
    base_log = (base / "train.log").read_text()
    for step in (2, 4):
        files = len(
            json.loads((base / "checkpoints" / f"iter_{step:07d}" / "manifest.json").read_text())[
                "files"
            ]
        )
        assert (
            f"wrote checkpoint {base / 'checkpoints' / f'iter_{step:07d}'} ({files} files, "
            in base_log
        )
    assert base_log.count("; checksums ") == 2

    # resume=auto: the newest checkpoint has 4 KiB flipped in a shard and metrics.jsonl a torn
    # last line (killed mid-write): it resumes from iter_2, says why, and redoes steps 3-4
    # exactly.
    auto = tmp_path / "auto"
    shutil.copytree(base, auto)
    flip_bytes(str(auto / "checkpoints" / "iter_0000004" / shard))
    with open(auto / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "split": "tra')
    run_train(auto, data_file, tok_dir, *FOUR_STEPS, "checkpoint.resume=auto")
    log = (auto / "train.log").read_text()
    bad = auto / "checkpoints" / "iter_0000004"
    assert f"WARNING: skipped checkpoint {bad}: {shard}: xxh3_128 digest" in log
    assert (
        f"(moved to {bad}.corrupt)" in log
        and (auto / "checkpoints" / "iter_0000004.corrupt").is_dir()
    )
    assert f"resumed from {auto / 'checkpoints' / 'iter_0000002'} at step 2" in log
    assert "dropped its torn last line" in log
    assert exact_metrics(auto) == exact_metrics(base)
    assert checkpoint_files(bad) == checkpoint_files(base / "checkpoints" / "iter_0000004")

    # Naming the corrupted checkpoint explicitly -- as checkpoint.resume, model.load, or to the
    # Hugging Face converter -- is an error naming the file.
    corrupt = tmp_path / "corrupt" / "iter_0000004"
    shutil.copytree(base / "checkpoints" / "iter_0000004", corrupt)
    flip_bytes(str(corrupt / shard))
    expected = f"CheckpointIntegrityError: checkpoint {corrupt} failed verification: {shard}: "
    for name, overrides in (
        ("explicit", [f"checkpoint.resume={corrupt}"]),
        ("model_load", [f"model.load={corrupt}"]),
    ):
        error = _failure(
            _train,
            world_size=1,
            run_dir=str(tmp_path / name),
            data_file=data_file,
            tok_dir=tok_dir,
            overrides=["train.train_iters=5", *overrides],
        )
        assert expected in error, (name, error[-1500:])
    # The converter says it in one line, as the trainer does (no traceback of its own).
    error = _failure(_convert, world_size=1, load=str(corrupt), save=str(tmp_path / "hf"))
    assert f"exit 2: error: {expected.split(': ', 1)[1]}" in error, error[-1500:]
    assert not (tmp_path / "hf").exists()


def test_a_payload_in_a_tensor_item_is_refused_at_load_naming_its_file(tmp_path, fixture_files):
    """The tensor items of a shard are read by torch DCP (weights_only=True): a payload there,
    with .metadata and the manifest rewritten to match, is refused and traced to its file."""
    data_file, tok_dir = fixture_files
    run_train(
        tmp_path / "run", data_file, tok_dir, "train.train_iters=2", "checkpoint.save_interval=2"
    )
    ckpt = tmp_path / "planted" / "iter_0000002"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "iter_0000002", ckpt)
    marker = tmp_path / "PAYLOAD_RAN"
    shard = plant_in_dcp_item(str(ckpt), str(marker), byte_item=False)
    error = _failure(
        _train,
        world_size=1,
        run_dir=str(tmp_path / "resumed"),
        data_file=data_file,
        tok_dir=tok_dir,
        overrides=["train.train_iters=3", f"checkpoint.resume={ckpt}"],
    )
    assert f"UnsafeCheckpointError: checkpoint {ckpt} failed verification: {shard}: item " in error
    assert "refused" in error and not marker.exists()


# ----------------------------------------------------------------------------------------------
# one run per run_dir, and SIGTERM


def _wait_for(predicate, what: str, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_one_run_per_run_dir_and_sigterm_saves(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    run_dir = tmp_path / "run"
    ctx = process_context()
    first = ctx.Process(
        target=_train,
        kwargs=dict(
            run_dir=str(run_dir),
            data_file=data_file,
            tok_dir=tok_dir,
            overrides=["train.train_iters=500", "checkpoint.save_interval=0"],
        ),
    )
    first.start()
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, "step 1")

    # A second run on the folder, continuing or fresh, is refused while the first holds it.
    for resume in ("auto", "none"):
        error = _failure(
            _train,
            world_size=1,
            run_dir=str(run_dir),
            data_file=data_file,
            tok_dir=tok_dir,
            overrides=["train.train_iters=2", f"checkpoint.resume={resume}"],
        )
        assert f"run_dir {run_dir} is in use by another run (pid {first.pid} on " in error

    # SIGTERM: the run saves the step it is in and exits with 128 + 15.
    os.kill(first.pid, signal.SIGTERM)
    first.join(120)
    assert first.exitcode == 143
    log = (run_dir / "train.log").read_text()
    assert "received SIGTERM: saving a checkpoint at the end of this step" in log
    stopped = [line for line in log.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1 and "continue with checkpoint.resume=auto" in stopped[0]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    ckpt = run_dir / "checkpoints" / f"iter_{step:07d}"
    assert stopped[0] == (
        f"stopped by SIGTERM after step {step}: saved checkpoint {ckpt}; "
        f"continue with checkpoint.resume=auto"
    )

    # A fresh run over it is refused and changes nothing.
    before = tree_digest(str(run_dir))
    error = _failure(
        _train,
        world_size=1,
        run_dir=str(run_dir),
        data_file=data_file,
        tok_dir=tok_dir,
        overrides=["train.train_iters=2"],
    )
    assert f"run_dir {run_dir} already holds a run (1 checkpoint folder(s)" in error
    assert tree_digest(str(run_dir)) == before

    # resume=auto continues it (the stale lock of the killed run is no obstacle).
    run_train(
        run_dir, data_file, tok_dir, f"train.train_iters={step + 1}", "checkpoint.resume=auto"
    )
    assert sorted(read_metrics(run_dir)) == list(range(1, step + 2))

    # overwrite=true moves the old run aside, byte for byte, and starts afresh.
    before = tree_digest(str(run_dir))
    run_train(run_dir, data_file, tok_dir, "train.train_iters=1", "checkpoint.overwrite=true")
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert tree_digest(str(moved)) == {k: v for k, v in before.items() if k != "run.lock"}
    assert sorted(read_metrics(run_dir)) == [1]
    assert os.listdir(run_dir / "checkpoints") == ["iter_0000001"]
    assert f"moved the previous run to {moved}" in (run_dir / "train.log").read_text()


def _train_signalled(run_dir, data_file, tok_dir, overrides, signal_rank, at_step):
    """train() where global rank ``signal_rank`` alone gets SIGTERM during step ``at_step``."""
    import torch.distributed as dist

    from dpo_megatron.parallel.shutdown import RunInterrupted
    from dpo_megatron.training.trainer import Trainer

    real_step = Trainer.train_step

    def train_step(self):
        out = real_step(self)
        if self.counters.step == at_step and dist.get_rank() == signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    Trainer.train_step = train_step
    try:
        _train(run_dir, data_file, tok_dir, overrides)
    except RunInterrupted as e:
        return {"code": e.code, "step": e.step, "checkpoint": e.checkpoint, "saved": e.saved}
    return None


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    common = [
        "train.train_iters=4",
        "checkpoint.save_interval=0",
        "checkpoint.keep_last_n=0",
        "parallel.tensor_model_parallel_size=2",
    ]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_train(
        straight, data_file, tok_dir, *common, "checkpoint.save_interval=2", world_size=2, tp=2
    )
    results = run_ranks(
        _train_signalled,
        world_size=2,
        run_dir=str(stopped),
        data_file=data_file,
        tok_dir=tok_dir,
        overrides=common,
        signal_rank=1,
        at_step=2,
    )
    ckpt = stopped / "checkpoints" / "iter_0000002"
    assert results == [{"code": 143, "step": 2, "checkpoint": str(ckpt), "saved": True}] * 2
    assert sorted(read_metrics(stopped)) == [1, 2]
    run_train(stopped, data_file, tok_dir, *common, "checkpoint.resume=auto", world_size=2, tp=2)
    assert exact_metrics(stopped) == exact_metrics(straight)
    for name in ("iter_0000002", "iter_0000004"):
        assert checkpoint_files(stopped / "checkpoints" / name) == checkpoint_files(
            straight / "checkpoints" / name
        )


# ----------------------------------------------------------------------------------------------
# NaN steps


def _save_before_any_update(run_dir):
    from tests.engine import random_pairs, tiny_trainer

    trainer = tiny_trainer(
        random_pairs(4, 0, lambda i: (3, 2, 2)), run_dir=run_dir, steps=1, model={"num_layers": 2}
    )
    path = trainer.checkpointer.save(trainer.counters)
    trainer.close()
    return path, sorted(os.listdir(run_dir))


def test_no_checkpoint_of_a_skipped_step_nor_before_the_first_update(tmp_path, fixture_files):
    from tests.training.test_lifecycle import _nan_after

    data_file, tok_dir = fixture_files
    message = run_ranks(
        _nan_after,
        world_size=1,
        step_from=1,
        run_dir=str(tmp_path / "nan"),
        data_file=data_file,
        tok_dir=tok_dir,
        overrides=[
            "train.train_iters=4",
            "checkpoint.save_interval=1",
            "train.max_nonfinite_steps=3",
        ],
    )[0]
    assert "3 steps in a row (up to step 3)" in message and "Last checkpoint: None" in message
    assert not (tmp_path / "nan" / "checkpoints").exists()  # nothing written, no .tmp
    log = (tmp_path / "nan" / "train.log").read_text()
    assert "step 1: its update was skipped (non-finite loss or gradient): no checkpoint" in log

    path, listing = run_ranks(
        _save_before_any_update, world_size=1, run_dir=str(tmp_path / "fresh")
    )[0]
    assert path is None and "checkpoints" not in listing
    assert (
        "step 0: no optimizer update applied yet" in (tmp_path / "fresh" / "train.log").read_text()
    )


# ----------------------------------------------------------------------------------------------
# the launcher: kill -9 at random moments, Ctrl-C


KILL_RUN = [
    "train.train_iters=8",
    "checkpoint.save_interval=2",
    "checkpoint.keep_last_n=0",
    "data.eval_fraction=0.2",
    "train.eval_interval=3",
    "parallel.tensor_model_parallel_size=2",
]
"""2 ranks, 8 steps, a checkpoint every 2 and an evaluation every 3 steps: a random moment
lands in start-up, a step, an evaluation or a save."""


def _launcher_args(run_dir, data_file, tok_dir, *overrides) -> list[str]:
    config = Path(run_dir).parent / "empty.yaml"
    config.write_text("{}\n")
    return [
        "bash",
        str(ROOT / "scripts" / "pretrain_dpo.sh"),
        "--config",
        str(config),
        *tiny_overrides(run_dir, data_file, tok_dir),
        *KILL_RUN,
        *overrides,
    ]


def _launch(run_dir, data_file, tok_dir, *overrides, env=None) -> tuple[subprocess.Popen, str]:
    """``scripts/pretrain_dpo.sh`` (torchrun, 2 ranks) in its own session; returns the process
    and the marker in its environment (to find its ranks)."""
    marker = uuid.uuid4().hex
    extra = env or {}
    env = launcher_env(DPO_TEST_MARKER=marker, **extra)
    log = open(Path(run_dir).parent / f"{Path(run_dir).name}-{marker[:6]}.out", "w")
    proc = subprocess.Popen(
        _launcher_args(run_dir, data_file, tok_dir, *overrides),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.output_path = log.name
    return proc, marker


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (the launcher and its ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"DPO_TEST_MARKER={marker}".encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _run_to_end(run_dir, data_file, tok_dir, *overrides) -> str:
    proc, _ = _launch(run_dir, data_file, tok_dir, *overrides)
    rc = proc.wait(timeout=900)
    output = Path(proc.output_path).read_text()
    assert rc == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, fixture_files):
    """The reference: the same job, launched the same way, never interrupted."""
    data_file, tok_dir = fixture_files
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    _run_to_end(run_dir, data_file, tok_dir)
    return run_dir


def _assert_same_run(run_dir, straight) -> None:
    assert exact_metrics(run_dir) == exact_metrics(straight)
    names = sorted(os.listdir(straight / "checkpoints"))
    # Every checkpoint of the reference, plus possibly the one a signal asked for.
    assert set(names) <= set(os.listdir(run_dir / "checkpoints"))
    for name in names:
        assert checkpoint_files(run_dir / "checkpoints" / name) == checkpoint_files(
            straight / "checkpoints" / name
        ), name


def _train_records(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    return path.read_text().count('"split": "train"') if path.exists() else 0


def test_kill_9_of_the_launcher_at_random_moments_then_resume_is_exact(
    tmp_path, fixture_files, straight_run
):
    """Twice in one run: kill -9 the launcher's process group (bash, torchrun) at a random moment:
    after a random number of logged steps (first 0-3, 0: as soon as the run folder is open, i.e.
    during start-up; then, in the run resumed from that, 4-6) plus up to 1.5 s (or 1.5 steps
    where a step is shorter), so that it lands in start-up, a step, an evaluation or a save. Its
    ranks, in sessions of their own, and the checkpoint writers they fork must be gone within
    10 s (parent-death signal). The second kill hits a resumed run, so the resume
    after the first kill continues into it: resume=auto after the second must finish with the
    reference's metrics and checkpoint files, bit for bit (a resume that drifted before the
    second kill leaves its steps' records or checkpoints behind, which then differ). Every run
    draws new moments (the seed is printed); ``DPO_KILL_SEED`` replays a failing draw."""
    data_file, tok_dir = fixture_files
    straight = straight_run
    seed = int(os.environ.get("DPO_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    # The moment after the awaited step: up to 1.5 s, or 1.5 steps where steps are faster (a
    # quiet machine runs this model's step in a fraction of a second: 1.5 s after step 6 the
    # run had ended, and the kill tested nothing).
    steps = read_metrics(straight, "train").values()
    window = min(1.5, 1.5 * sum(r["step_time_s"] for r in steps) / len(steps))
    for trial in range(2):
        # One draw in each half of the run: start-up or steps 1-3, then steps 4-6 (of the run
        # resumed from the first kill's checkpoint: it keeps the records up to it).
        after_steps = rng.randint(*((0, 3), (4, 6))[trial])
        extra = rng.uniform(0.0, 1.0) * window
        resume = ["checkpoint.resume=auto"] if trial else []
        proc, marker = _launch(run_dir, data_file, tok_dir, *resume)
        # The resumed run counts once it has logged a step of its own: by then it has dropped
        # the records past its checkpoint that the killed run left.
        _wait_for(
            lambda: (
                (run_dir / "train.log").exists()
                and (not trial or "[train] step " in Path(proc.output_path).read_text())
                and _train_records(run_dir) >= after_steps
            ),
            f"{after_steps} steps",
        )
        time.sleep(extra)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while _processes_with(marker) and time.time() < deadline:
            time.sleep(0.1)
        where = (
            f"seed {seed}, trial {trial}: killed {extra:.2f} s after {after_steps} steps; "
            f"{_train_records(run_dir)} step records, checkpoints "
            f"{sorted(p.name for p in (run_dir / 'checkpoints').glob('*'))}"
        )
        print(where)
        assert not _processes_with(marker), f"ranks outlived the launcher ({where})"
        assert not (run_dir / "checkpoints" / "iter_0000008").exists(), where
    _run_to_end(run_dir, data_file, tok_dir, "checkpoint.resume=auto")
    _assert_same_run(run_dir, straight)


def _entry(ending: str, **variables: str) -> dict:
    """The environment that runs tests/launcher_entry.py's ``ending`` through the launcher."""
    return {
        "DPO_MEGATRON_ENTRY": "tests.launcher_entry",
        "DPO_TEST_ENDING": ending,
        "PYTHONPATH": str(ROOT),
        **variables,
    }


def test_ctrl_c_saves_at_one_step_on_every_rank_and_resume_is_exact(
    tmp_path, fixture_files, straight_run
):
    """SIGINT to torchrun (what Ctrl-C does: torch elastic forwards it to its ranks): every rank
    stops after the same step with a checkpoint of it; the run exits non-zero. The run resumed
    from it gets two Ctrl-C inside a step (each step made 60 s long): the second one stops it at
    once, within seconds, without finishing the step nor saving, with the launcher's line and
    status 130 and no traceback (neither torchrun's nor CPython's ``Signal N ignored due to race
    condition``). resume=auto then finishes exactly like the reference."""
    data_file, tok_dir = fixture_files
    straight = straight_run
    run_dir = tmp_path / "run"
    proc, marker = _launch(run_dir, data_file, tok_dir)
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, "step 1")
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    output = Path(proc.output_path).read_text()
    stopped = [line for line in output.splitlines() if line.startswith("stopped by SIGINT")]
    assert len(stopped) == 1, output[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert f"saved checkpoint {run_dir / 'checkpoints' / f'iter_{step:07d}'}" in stopped[0]
    assert not _processes_with(marker)

    saved = sorted(os.listdir(run_dir / "checkpoints"))
    slow = _entry("slow_steps", DPO_TEST_STEP_SLEEP="60")
    proc, marker = _launch(run_dir, data_file, tok_dir, "checkpoint.resume=auto", env=slow)
    output = Path(proc.output_path)
    _wait_for(lambda: "resumed from " in output.read_text(), "the resumed run", timeout=900)
    os.kill(proc.pid, signal.SIGINT)
    _wait_for(lambda: "received SIGINT" in output.read_text(), "rank 0's signal line")
    second = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert time.monotonic() - second < 30  # not the 60 s step, its save and the stop
    text = output.read_text()
    assert "Traceback" not in text and "race condition" not in text, text[-3000:]
    assert _tail_after(text, "received SIGINT")[1:] == [
        "launcher: the job stopped at once on a second SIGINT (forwarded to every rank; the "
        "step in progress was not saved: continue from the last checkpoint with "
        f"checkpoint.resume=auto); rank 0's output is also in {run_dir / 'train.log'}"
    ]
    assert sorted(os.listdir(run_dir / "checkpoints")) == saved
    assert not _processes_with(marker)
    _run_to_end(run_dir, data_file, tok_dir, "checkpoint.resume=auto")
    _assert_same_run(run_dir, straight)


# ----------------------------------------------------------------------------------------------
# stops found inside the ranks, through the launcher: their line, no traceback, a clear status


def _messages(output: str) -> list[str]:
    """The output's lines but the per-step / per-evaluation log lines and blank lines."""
    return [
        line
        for line in output.splitlines()
        if line.strip() and not line.startswith(("[train]", "[eval]"))
    ]


def _tail_after(output: str, first: str) -> list[str]:
    """:func:`_messages` from the first line starting with ``first``."""
    lines = _messages(output)
    starts = [i for i, line in enumerate(lines) if line.startswith(first)]
    assert starts, output[-3000:]
    return lines[starts[0] :]


def test_sigterm_through_the_launcher_ends_in_its_lines_and_resumes_exactly(
    tmp_path, fixture_files, straight_run
):
    """SIGTERM to the launcher (a scheduler's, ``kill``): the ranks save the step they are in,
    rank 0 says so, the launcher adds one line and exits with 143 (128 + 15); resume=auto then
    finishes exactly like the run never stopped. No ``SignalException`` traceback from torchrun
    after the save, and the signal is announced once, not by each rank."""
    data_file, tok_dir = fixture_files
    run_dir = tmp_path / "run"
    proc, marker = _launch(run_dir, data_file, tok_dir)
    # A shared CI machine can take minutes to start 2 ranks: wait for step 1 that long.
    _wait_for(lambda: _train_records(run_dir) >= 1, "step 1", timeout=900)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == 143
    output = Path(proc.output_path).read_text()
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    assert "death signal" not in output and "closing signal" not in output, output[-3000:]
    stopped = [line for line in output.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1, output[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    ckpt = run_dir / "checkpoints" / f"iter_{step:07d}"
    tail = _tail_after(output, "received SIGTERM")
    assert len(tail) == 4, tail
    assert tail[0] == (
        "received SIGTERM: saving a checkpoint at the end of this step, then "
        "stopping (Ctrl-C / SIGINT stops at once)"
    )
    assert tail[1].startswith(f"wrote checkpoint {ckpt} ("), tail
    assert tail[2:] == [
        f"stopped by SIGTERM after step {step}: saved checkpoint {ckpt}; continue with "
        f"checkpoint.resume=auto",
        f"launcher: the job stopped on SIGTERM (forwarded to every rank; rank 0's line above "
        f"says what was saved); rank 0's output is also in {run_dir / 'train.log'}",
    ]
    assert not _processes_with(marker)

    # SIGTERM to rank 1 alone (a scheduler's, the OOM killer's) as the resumed run's first save
    # starts, just after the ranks agreed that no signal had come: every rank stops once that
    # checkpoint is written (not a step later with one more), and the launcher reports it as
    # the signal it is: status 143, its line, no torchrun traceback.
    first_save = step + 2 - step % 2  # checkpoint.save_interval=2
    proc, marker = _launch(
        run_dir, data_file, tok_dir, "checkpoint.resume=auto", env=_entry("sigterm_in_first_save")
    )
    assert proc.wait(timeout=300) == 143
    output = Path(proc.output_path).read_text()
    assert "Traceback" not in output and "received SIGTERM" not in output, output[-3000:]
    ckpt = run_dir / "checkpoints" / f"iter_{first_save:07d}"
    tail = _tail_after(output, f"wrote checkpoint {ckpt} (")
    assert tail[1:] == [
        f"stopped by SIGTERM after step {first_save}: saved checkpoint {ckpt}; continue with "
        f"checkpoint.resume=auto",
        f"launcher: the job stopped on SIGTERM (sent to a rank, not to the launcher; rank 0's "
        f"line above says what was saved); rank 0's output is also in {run_dir / 'train.log'}",
    ]
    assert not (run_dir / "checkpoints" / f"iter_{first_save + 1:07d}").exists()
    assert max(read_metrics(run_dir)) == first_save
    assert not _processes_with(marker)
    _run_to_end(run_dir, data_file, tok_dir, "checkpoint.resume=auto")
    _assert_same_run(run_dir, straight_run)


def test_a_run_folder_turning_read_only_between_saves_ends_in_one_line(tmp_path, fixture_files):
    """The disk of the run folder turns read-only right after the step-2 checkpoint (an ext4
    error; TensorBoard on): rank 0's next write of its logs fails, every rank stops at that
    step's boundary with the ``error:`` line naming the file and the last checkpoint, the
    launcher adds its pointer, status 3, no traceback (TensorBoard's writer thread's
    included). Nothing written before is lost: the checkpoint verifies, metrics.jsonl holds
    steps 1-2 (a folder read-only from the start: ``tests/test_launcher.py``)."""
    from dpo_megatron.utils.exits import FAULT_EXIT

    data_file, tok_dir = fixture_files
    run_dir = tmp_path / "disk"  # the mount point (the launcher's output stays beside it)
    with ext4_turning_read_only(run_dir) as trigger:
        entry = _entry("fault_after_first_save", DPO_TEST_FAULT=trigger)
        proc, _ = _launch(run_dir, data_file, tok_dir, "logging.tensorboard=true", env=entry)
        assert proc.wait(timeout=300) == FAULT_EXIT == 3
        output = Path(proc.output_path).read_text()
        assert "Traceback" not in output and "Exception in thread" not in output, output[-3000:]
        ckpt = run_dir / "checkpoints" / "iter_0000002"
        assert _tail_after(output, "error:") == [
            f"error: writing the run's logs failed at step 3: read-only file system: cannot "
            f"write {run_dir / 'metrics.jsonl'}. Stopped there without saving; the last "
            f"checkpoint, {ckpt}, is intact: continue from it with checkpoint.resume=auto once "
            f"the disk can be written",
            f"launcher: the job stopped at the line above (rank 0; the other 1 rank(s) were "
            f"stopped); rank 0's output is also in {run_dir / 'train.log'}",
        ]
        assert verify_checkpoint(str(ckpt)).problems == []
        assert sorted(read_metrics(run_dir)) == [1, 2]
        assert list((run_dir / "tensorboard").iterdir())


def test_a_checkpoint_failing_its_checksum_and_the_nan_stop_end_in_one_line(
    tmp_path, fixture_files, straight_run
):
    """Two faults met by the ranks, through the launcher: resuming a checkpoint with a changed
    shard, and ``train.max_nonfinite_steps`` NaN steps in a row. Each ends with the rank's
    ``error:`` line and the launcher's pointer, exit status 3 (``utils.exits.FAULT_EXIT``), no
    traceback from any rank, no torchrun failure block."""
    from dpo_megatron.utils.exits import FAULT_EXIT

    data_file, tok_dir = fixture_files
    ckpt = tmp_path / "copied" / "iter_0000002"
    shutil.copytree(straight_run / "checkpoints" / "iter_0000002", ckpt)
    shard = sorted(p.name for p in ckpt.iterdir() if p.suffix == ".distcp")[0]
    flip_bytes(str(ckpt / shard))
    run_dir = tmp_path / "corrupt"
    proc, _ = _launch(run_dir, data_file, tok_dir, f"checkpoint.resume={ckpt}")
    assert proc.wait(timeout=300) == FAULT_EXIT == 3
    output = Path(proc.output_path).read_text()
    assert "Traceback" not in output, output[-3000:]
    tail = _tail_after(output, "error:")
    assert len(tail) == 2, tail
    assert tail[0].startswith(f"error: checkpoint {ckpt} failed verification: {shard}: ")
    assert tail[1] == (
        f"launcher: the job stopped at the line above (rank 0; the other 1 "
        f"rank(s) were stopped); rank 0's output is also in "
        f"{run_dir / 'train.log'}"
    )

    run_dir = tmp_path / "nan"
    proc, _ = _launch(
        run_dir,
        data_file,
        tok_dir,
        "train.max_nonfinite_steps=2",
        env={
            "DPO_MEGATRON_ENTRY": "tests.launcher_entry",
            "DPO_TEST_ENDING": "nan_from_step_3",
            "PYTHONPATH": str(ROOT),
        },
    )
    assert proc.wait(timeout=300) == FAULT_EXIT
    output = Path(proc.output_path).read_text()
    assert "Traceback" not in output, output[-3000:]
    assert _tail_after(output, "error:") == [
        f"error: 2 steps in a row (up to step 4) had a NaN/Inf loss or gradient "
        f"(train.max_nonfinite_steps=2); stopping. Last checkpoint: "
        f"{run_dir / 'checkpoints' / 'iter_0000002'}",
        f"launcher: the job stopped at the line above (rank 0; the other 1 rank(s) were "
        f"stopped); rank 0's output is also in {run_dir / 'train.log'}",
    ]


def _build_with_load(run_dir, load):
    from tests.engine import random_pairs, tiny_trainer

    try:
        tiny_trainer(
            random_pairs(4, 0, lambda i: (3, 2, 2)),
            run_dir=run_dir,
            steps=1,
            model={"num_layers": 2},
            load=load,
        )
    except Exception as e:  # the test reads which error ended the build
        return f"{type(e).__name__}: {e}"
    return None


def test_a_run_failing_while_it_is_built_releases_its_folder(tmp_path):
    """A run that ends in an error while it is built (here ``model.load`` of a folder with no
    checkpoint) clears its lock as a finished run does: the next start takes the folder without
    'took over the lock of a run that is gone', the note for a killed run."""
    run_dir = tmp_path / "run"
    error = run_ranks(
        _build_with_load, world_size=1, run_dir=str(run_dir), load=str(tmp_path / "empty")
    )[0]
    assert error is not None and str(tmp_path / "empty") in error
    assert (run_dir / "run.lock").read_text() == ""
    from dpo_megatron.training.run_dir import RunLock

    lock = RunLock.acquire(str(run_dir))
    try:
        assert lock.stale_owner is None
    finally:
        lock.release()
