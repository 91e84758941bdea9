"""The run lifecycle through ``dpo_megatron.cli.train.train``: exact resume, NaN/Inf skipping, a
kill during a save, evaluation with samples, and the SFT -> DPO hand-off.

Each run is a whole ``train(cfg)`` on a tiny random model (4 layers, hidden 64) with a 400-token
BPE tokenizer trained in-process and a small preference file written here; every run is a fresh
forked process (megatron-core keeps global state).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dpo_megatron.utils.exits import USER_ERROR_EXIT
from tests.data.fixtures import CORPUS, tiny_hf_tokenizer
from tests.engine import TINY, model_overrides
from tests.multirank import process_context, run_ranks

pytestmark = pytest.mark.slow

TINY_MODEL = model_overrides(
    {**{k: v for k, v in TINY.items() if k != "vocab_size"}, "max_position_embeddings": 128}
)
"""The engine tests' tiny model as command-line overrides; the vocabulary is the tokenizer's
(each launch sets ``model.vocab_size``)."""


def write_fixture(folder: Path, rows: int = 24, seed: int = 0) -> tuple[str, str]:
    """A standard-format preference file (prompt / chosen / rejected strings from the tokenizer's
    corpus words) and the tiny tokenizer saved as a folder. Returns (data file, tokenizer dir)."""
    words = " ".join(CORPUS).replace(".", " ").replace("?", " ").replace("!", " ").split()
    rng = random.Random(seed)
    data = []
    for i in range(rows):
        prompt = " ".join(rng.choices(words, k=3 + i % 4)) + "?"
        chosen = " ".join(rng.choices(words, k=2 + i % 3)) + "."
        rejected = " ".join(rng.choices(words, k=4 - i % 3)) + " no."
        data.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    folder.mkdir(parents=True, exist_ok=True)
    data_file = folder / "pairs.json"
    data_file.write_text(json.dumps(data))
    tok_dir = folder / "tokenizer"
    if not tok_dir.exists():
        tiny_hf_tokenizer().save_pretrained(str(tok_dir))
    return str(data_file), str(tok_dir)


def fixture_data_overrides(data_file: str, tok_dir: str) -> list[str]:
    """The ``data.*`` overrides for :func:`write_fixture`'s file and tokenizer: the standard
    format, 32 tokens a sequence (16 of prompt), no data cache, no data report."""
    return [
        f"data.path={data_file}",
        f"data.tokenizer={tok_dir}",
        "data.format=standard",
        "data.max_length=32",
        "data.max_prompt_length=16",
        "data.cache_dir=none",
        "data.verbose=false",
    ]


def tiny_overrides(run_dir, data_file: str, tok_dir: str) -> list[str]:
    """The overrides of a run of the tiny model on the fixture data (vocab 400), CPU, no data
    cache: for :func:`tiny_config` and for command lines through the launcher."""
    return [
        f"run_dir={run_dir}",
        *fixture_data_overrides(data_file, tok_dir),
        "model.vocab_size=400",
        *TINY_MODEL,
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        "train.lr=1e-3",
        "train.lr_decay_style=cosine",
        "train.lr_warmup_iters=1",
        "train.weight_decay=0.01",
        "logging.tensorboard=false",
    ]


def tiny_config(run_dir, data_file: str, tok_dir: str, *overrides: str):
    """A DPOConfig for the tiny model on the fixture data (vocab 400), CPU, no data cache."""
    from dpo_megatron.config import load_config

    return load_config(None, [*tiny_overrides(run_dir, data_file, tok_dir), *overrides])


def run_train(
    run_dir, data_file, tok_dir, *overrides, world_size: int = 1, tp: int = 1, pp: int = 1
):
    """``train(cfg)`` on ``world_size`` forked ranks; returns rank 0's last-step metrics."""
    return run_ranks(
        _train,
        world_size=world_size,
        run_dir=str(run_dir),
        data_file=data_file,
        tok_dir=tok_dir,
        overrides=[
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            *overrides,
        ],
    )[0]


def _train(run_dir, data_file, tok_dir, overrides):
    from dpo_megatron.cli.train import train

    return train(tiny_config(run_dir, data_file, tok_dir, *overrides))


def _not_json(token: str):
    raise ValueError(f"{token} is not JSON")


def read_metrics(run_dir, split: str = "train") -> dict[int, dict]:
    """metrics.jsonl records of one split by step (the last record of a step wins), parsed as
    strict JSON (a bare NaN / Infinity token fails)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line, parse_constant=_not_json)
            if record["split"] == split:
                out[record["step"]] = record
    return out


def model_tensors(ckpt_dir) -> dict:
    """The model tensors of a checkpoint, unsharded (optimizer state and extra states left
    out); read with torch's DCP converter, which needs no process group."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(ckpt_dir), os.path.join(tmp, "state.pt"))
        state = torch.load(os.path.join(tmp, "state.pt"), weights_only=True)
    return {
        k: v.numpy()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not k.startswith("optimizer")
    }


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert (a[key] == b[key]).all(), key
    assert all(np.isfinite(v).all() for v in a.values())


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("lifecycle_data"))


def test_resume_is_exact_and_auto_picks_latest(tmp_path, fixture_files):
    """4 steps straight vs 2 steps, 'killed' (the later checkpoint removed, a stale .tmp left),
    resumed with checkpoint.resume=auto for 2 more: same loss at every step, same weights."""
    data_file, tok_dir = fixture_files
    common = ["train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last_n=0"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_train(full, data_file, tok_dir, *common)
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "iter_0000004")
    (resumed / "checkpoints" / "iter_0000004.tmp").mkdir()  # an interrupted save
    run_train(resumed, data_file, tok_dir, *common, "checkpoint.resume=auto")

    a, b = read_metrics(full), read_metrics(resumed)
    assert sorted(b) == [1, 2, 3, 4]  # the resumed run rewrote steps 3-4, no duplicates
    for step in (3, 4):
        assert b[step]["loss"] == a[step]["loss"], step
        assert b[step]["lr"] == a[step]["lr"]
        assert b[step]["grad_norm"] == a[step]["grad_norm"]
    assert_same_tensors(
        model_tensors(full / "checkpoints" / "iter_0000004"),
        model_tensors(resumed / "checkpoints" / "iter_0000004"),
    )
    state = json.loads((resumed / "checkpoints" / "iter_0000004" / "train_state.json").read_text())
    assert state["step"] == 4 and state["sampler"]["step_in_epoch"] == 4


def _nan_after(step_from: int, run_dir, data_file, tok_dir, overrides):
    """train() with a loss that returns NaN from optimizer step ``step_from`` on."""
    import dpo_megatron.cli.train as train_module
    import dpo_megatron.training.trainer as trainer_module
    from dpo_megatron.parallel.shutdown import NonFiniteLossError

    real_build_loss = trainer_module.build_loss
    calls = {"n": 0}

    def build_loss(cfg):
        loss_fn = real_build_loss(cfg)
        real_call = loss_fn.__call__

        class NaNAfter(type(loss_fn)):
            def __call__(self, *args, **kwargs):
                losses, metrics = real_call(*args, **kwargs)
                calls["n"] += 1
                # 4 micro-batches per step (global 4, micro 1); eval calls come later.
                if (calls["n"] - 1) // 4 + 1 >= step_from:
                    losses = losses * float("nan")
                return losses, metrics

        loss_fn.__class__ = NaNAfter
        return loss_fn

    trainer_module.build_loss = build_loss
    try:
        return train_module.train(tiny_config(run_dir, data_file, tok_dir, *overrides))
    except NonFiniteLossError as e:
        return str(e)


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    message = run_ranks(
        _nan_after,
        world_size=1,
        step_from=3,
        run_dir=str(tmp_path),
        data_file=data_file,
        tok_dir=tok_dir,
        overrides=[
            "train.train_iters=6",
            "checkpoint.save_interval=1",
            "train.max_nonfinite_steps=2",
            "checkpoint.keep_last_n=0",
        ],
    )[0]
    assert "2 steps in a row (up to step 4)" in message
    assert "iter_0000002" in message  # the last checkpoint, named in the error
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [1, 2, 3, 4]
    assert [metrics[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    # Strict JSON: a non-finite value is the string "NaN", which float() reads back.
    assert metrics[3]["loss"] == "NaN" and math.isnan(float(metrics[3]["grad_norm"]))
    # No checkpoint at a skipped step (save_interval=1): step 3's update was skipped, and the
    # run stopped at step 4 before its save.
    ckpts = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["iter_0000001", "iter_0000002"]
    assert all(np.isfinite(v).all() for v in model_tensors(ckpts / "iter_0000002").values())
    assert "step 3: its update was skipped" in (tmp_path / "train.log").read_text()


def _train_and_hang_in_second_save(run_dir, data_file, tok_dir):
    """train() whose second checkpoint save writes its tensors, then blocks (to be killed)."""
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save
    saves = {"n": 0}

    def save(state, ckpt_dir, *args, **kwargs):
        result = real_save(state, ckpt_dir, *args, **kwargs)
        saves["n"] += 1
        if saves["n"] == 2:
            Path(ckpt_dir, "HANGING").touch()
            time.sleep(600)
        return result

    dist_checkpointing.save = save
    _train(
        run_dir,
        data_file,
        tok_dir,
        ["train.train_iters=4", "checkpoint.save_interval=1", "checkpoint.keep_last_n=0"],
    )


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    ctx = process_context()  # forkserver: forking the threaded pytest process can hang the child
    proc = ctx.Process(
        target=_train_and_hang_in_second_save,
        kwargs=dict(run_dir=str(tmp_path), data_file=data_file, tok_dir=tok_dir),
    )
    proc.start()
    marker = tmp_path / "checkpoints" / "iter_0000002.tmp" / "HANGING"
    deadline = time.time() + 120
    while not marker.exists() and proc.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the second save never started"
    os.kill(proc.pid, signal.SIGKILL)  # killed mid-save: tensors written, not yet renamed
    proc.join()

    from dpo_megatron.checkpointing.training_checkpoint import find_latest_checkpoint

    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "iter_0000002.tmp" / "metadata.json").exists()  # a full-looking partial
    assert find_latest_checkpoint(str(ckpts)) == str(ckpts / "iter_0000001")
    # resume=auto continues from step 1 and finishes the run.
    run_train(
        tmp_path,
        data_file,
        tok_dir,
        "train.train_iters=3",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last_n=2",
        "checkpoint.resume=auto",
    )
    assert sorted(os.listdir(ckpts)) == ["iter_0000002", "iter_0000003"]
    assert sorted(read_metrics(tmp_path)) == [1, 2, 3]


def test_eval_metrics_and_greedy_samples(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    run_train(
        tmp_path,
        data_file,
        tok_dir,
        "train.train_iters=2",
        "data.eval_fraction=0.2",
        "train.eval_interval=1",
        "train.sample_during_eval=true",
        "train.eval_num_samples=2",
        "train.eval_sample_max_new_tokens=4",
        "logging.tensorboard=true",
    )
    evals = read_metrics(tmp_path, "eval")
    # step 0 (train.eval_at_start, on by default: the baseline, loss ln 2), every
    # eval_interval, the end not repeated
    assert sorted(evals) == [0, 1, 2]
    assert abs(evals[0]["loss"] - math.log(2)) < 1e-6 and evals[0]["rewards/margins"] == 0.0
    for record in evals.values():
        assert 0.0 <= record["rewards/accuracies"] <= 1.0
        assert {"loss", "rewards/margins", "logps/chosen", "logps/rejected"} <= set(record)
    samples = [
        json.loads(line)
        for line in (tmp_path / "samples" / "step_0000002.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 2 and all(set(s) == {"prompt", "sample", "chosen"} for s in samples)
    assert os.listdir(tmp_path / "tensorboard")
    # The end-of-run summary: steps, the last step's and the first and last evaluations'
    # values (as logged), where the checkpoint and the logs are.
    log = (tmp_path / "train.log").read_text()
    summary = log[log.index("run summary: ") :].splitlines()
    last, e0, e2 = read_metrics(tmp_path)[2], evals[0], evals[2]

    def brief(m):
        return (
            f"loss {m['loss']:.4f}, acc {m['rewards/accuracies']:.4f}, "
            f"margin {m['rewards/margins']:.4f}"
        )

    assert re.fullmatch(
        rf"run summary: 2 step\(s\) in \d+s; last step: {brief(last)}", summary[0]
    ), summary
    assert summary[1:] == [
        f"  eval: step 0 {brief(e0)} ({int(e0['items'])} pairs) -> step 2 {brief(e2)} "
        f"({int(e2['items'])} pairs)",
        f"  checkpoint: {tmp_path / 'checkpoints' / 'iter_0000002'}",
        f"  logs: {tmp_path / 'train.log'}, {tmp_path / 'metrics.jsonl'}, "
        f"{tmp_path / 'tensorboard'}",
    ]


def test_sft_then_dpo_from_its_checkpoint(tmp_path, fixture_files, capsys):
    """SFT (chosen-only rows) lowers the eval NLL; DPO from the SFT checkpoint (model.load, for
    policy and reference) starts at loss ln 2."""
    data_file, tok_dir = fixture_files
    sft_dir, dpo_dir = tmp_path / "sft", tmp_path / "dpo"
    run_train(
        sft_dir,
        data_file,
        tok_dir,
        "loss.name=sft",
        "train.train_iters=6",
        "data.eval_fraction=0.2",
        "train.eval_interval=1",
        "train.lr=3e-3",
    )
    evals = read_metrics(sft_dir, "eval")
    assert evals[6]["nll_loss"] < evals[1]["nll_loss"] - 0.3
    assert "rewards/margins" not in evals[6]
    dpo = run_train(
        dpo_dir, data_file, tok_dir, f"model.load={sft_dir}/checkpoints", "train.train_iters=1"
    )
    assert abs(read_metrics(dpo_dir)[1]["loss"] - math.log(2)) < 1e-6
    assert dpo["rewards/margins"] == 0.0

    # A checkpoint of another architecture is refused by name before it is loaded: a resume,
    # by the launcher's pre-check (else megatron-core's "Global shape mismatch" on every rank)
    resume = ["loss.name=sft", "checkpoint.resume=auto", "model.hidden_size=128"]
    out = _precheck(sft_dir, data_file, tok_dir, *resume)
    assert out.returncode == 1 and out.stdout == "", out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"config error: checkpoint.resume=auto: {sft_dir}/checkpoints/iter_0000006 holds a model "
        "with hidden_size=64 (its model_config.json), but this run builds hidden_size=128 (from "
        "the model.* keys): resume with the architecture it was saved with, or start the other "
        "model in another run_dir"
    ]
    # ... and model.load with a model.* key set to another value than its model_config.json's,
    # by a rank started without the pre-check (another launcher); the same values are fine, as
    # the DPO run above states them all
    from dpo_megatron.cli.train import main
    from dpo_megatron.config import check_model_sources

    load = f"model.load={sft_dir}/checkpoints"
    overrides = [*tiny_overrides(tmp_path / "again", data_file, tok_dir), load]
    check_model_sources(tiny_config(tmp_path / "again", data_file, tok_dir, load), None, overrides)
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as info:
            main([*overrides, "model.num_layers=3"])
    finally:
        gc.enable()  # the entry point pauses the collector until its run is built
    assert info.value.code == USER_ERROR_EXIT
    assert capsys.readouterr().err.strip().splitlines() == [
        f"config error: {load} holds a model with num_layers=4 (its model_config.json), but "
        "model.num_layers=3 is set: the checkpoint gives the architecture; drop "
        "model.num_layers or load a checkpoint of that architecture"
    ]
    assert not (tmp_path / "again").exists()


def _precheck(run_dir, data_file, tok_dir, *overrides):
    """``scripts/pretrain_dpo.sh`` with the tiny model's overrides (no config file's keys), for a
    command its pre-check refuses: nothing is launched."""
    from tests.scripts import run_script

    config = Path(run_dir).parent / "empty.yaml"
    config.write_text("{}\n")
    return run_script(
        "scripts/pretrain_dpo.sh",
        "--config",
        str(config),
        *tiny_overrides(run_dir, data_file, tok_dir),
        *overrides,
    )


def test_resume_with_another_optimizer_format_or_lr_schedule(tmp_path, fixture_files):
    data_file, tok_dir = fixture_files
    run_train(
        tmp_path, data_file, tok_dir, "train.train_iters=1", "train.use_distributed_optimizer=false"
    )
    with pytest.raises(
        RuntimeError,
        match="saved with train.use_distributed_optimizer=False but this run has True.*model.load=",
    ):
        run_train(
            tmp_path / "again",
            data_file,
            tok_dir,
            "train.train_iters=2",
            f"checkpoint.resume={tmp_path / 'checkpoints'}",
        )
    # Training longer: the checkpoint's LR schedule continues (megatron-core keeps it; the run
    # prints a note): its cosine decay ended at step 2, so step 3 runs at min_lr = 0, not the
    # 5e-4 a fresh 3-step schedule would give.
    run_train(
        tmp_path / "longer",
        data_file,
        tok_dir,
        "train.use_distributed_optimizer=false",
        "train.train_iters=3",
        f"checkpoint.resume={tmp_path / 'checkpoints'}",
    )
    assert read_metrics(tmp_path / "longer")[3]["lr"] == 0.0
    assert sorted(read_metrics(tmp_path / "longer")) == [2, 3]


def _real_data_config(run_dir, data_file, data_format, *overrides):
    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset
    ensure_smollm2 = assets.ensure_smollm2
    from dpo_megatron.config import load_config

    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"data.path={data_file}",
            f"data.format={data_format}",
            f"data.tokenizer={ensure_smollm2()}",
            "data.max_length=64",
            "data.max_prompt_length=32",
            "data.verbose=false",
            "model.vocab_size=49152",
            *TINY_MODEL,
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "logging.tensorboard=false",
            *overrides,
        ],
    )


def _train_real(run_dir, data_file, data_format, overrides):
    from dpo_megatron.cli.train import train

    return train(_real_data_config(run_dir, data_file, data_format, *overrides))


def test_sft_on_real_alpaca_then_dpo_on_real_pairs(tmp_path):
    """The acceptance path on the real LLaMA-Factory data (tiny random model, SmolLM2 tokenizer):
    SFT on alpaca_en_demo lowers the eval NLL; DPO on dpo_en_demo from its checkpoint starts at
    loss ln 2."""
    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset
    ensure_alpaca_en_demo = assets.ensure_alpaca_en_demo
    ensure_dpo_en_demo = assets.ensure_dpo_en_demo

    sft_dir, dpo_dir = tmp_path / "sft", tmp_path / "dpo"
    run_ranks(
        _train_real,
        world_size=1,
        run_dir=str(sft_dir),
        data_file=str(ensure_alpaca_en_demo()),
        data_format="alpaca",
        overrides=[
            "loss.name=sft",
            "train.train_iters=8",
            "train.lr=3e-3",
            "data.eval_fraction=0.01",
            "train.eval_interval=1",
            "train.eval_iters=2",
        ],
    )
    nll = {step: r["nll_loss"] for step, r in read_metrics(sft_dir, "eval").items()}
    assert sorted(nll) == list(range(0, 9))  # step 0: eval_at_start
    # Random init starts near ln 49152 = 10.8 nats/token; every step lowers the eval NLL.
    assert all(nll[s + 1] < nll[s] for s in range(1, 8)), nll
    assert nll[8] < nll[1] - 0.2, nll
    run_ranks(
        _train_real,
        world_size=1,
        run_dir=str(dpo_dir),
        data_file=str(ensure_dpo_en_demo()),
        data_format="sharegpt",
        overrides=[f"model.load={sft_dir}/checkpoints", "train.train_iters=1"],
    )
    assert abs(read_metrics(dpo_dir)[1]["loss"] - math.log(2)) < 1e-6
