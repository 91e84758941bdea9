"""The reference DPO repo's command line: parsing, the key-by-key translation, the layouts of its
trainers, and its errors (no training here; tests/training/test_frontend_dpo_repo_runs.py runs
it)."""

import json
import subprocess

import pytest

from dpo_megatron.frontends.dpo_repo import (
    REFERENCE_DEFAULTS,
    FrontendError,
    Translation,
    layout_for,
    parse_args,
    steps_for,
    translate,
)

SFT_LINE = (
    "model=blank_model model.name_or_path=/m datasets=[hh] loss=sft "
    "exp_name=anthropic_dpo_pythia69 gradient_accumulation_steps=2 batch_size=64 "
    "eval_batch_size=32 trainer=FSDPTrainer sample_during_eval=false"
).split()
DPO_LINE = (
    "model=blank_model model.name_or_path=/m datasets=[hh] loss=dpo loss.beta=0.1 "
    "exp_name=anthropic_dpo_pythia69 gradient_accumulation_steps=2 batch_size=32 "
    "eval_batch_size=32 trainer=FSDPTrainer sample_during_eval=false"
).split()


def _translate(words, devices=1, extra=()):
    args, engine = parse_args([*words, "local_run_dir=/runs/x", *extra])
    return translate(args, engine, devices=devices)


def test_values_parse_as_hydra_does():
    args, engine = parse_args(
        [
            "datasets=[hh,shp]",
            "lr=5e-7",
            "eval_every=20_000",
            "debug=true",
            "model.archive=null",
            "engine.data.num_proc=2",
        ]
    )
    assert args["datasets"] == ["hh", "shp"]
    assert args["lr"] == 5e-7 and args["eval_every"] == 20000
    assert args["debug"] is True and args["model.archive"] is None
    assert engine == ["data.num_proc=2"]
    assert args["optimizer"] == "RMSprop" and args["max_prompt_length"] == 256  # its defaults


def test_unknown_key_names_the_known_ones():
    with pytest.raises(
        FrontendError,
        match=r"unknown key 'batchsize'.*Did you mean "
        r"batch_size, eval_batch_size\?.*Known keys: seed, exp_name, "
        r"batch_size",
    ):
        parse_args(["batchsize=4"])
    with pytest.raises(FrontendError, match="expected key=value"):
        parse_args(["hh"])


def test_fsdp_sft_line_translation():
    t = _translate(SFT_LINE, devices=4)
    assert t.script == "scripts/pretrain_sft.sh"
    o = t.overrides
    for want in [
        "loss=sft",
        "model.hf_path=/m",
        "data.datasets=[Anthropic/hh-rlhf]",
        "data.formats=[hh]",
        "data.truncation_mode=keep_end",
        "data.eval_datasets=[Anthropic/hh-rlhf]",
        "data.eval_formats=[hh]",
        "data.eval_split=test",
        "parallel.data_parallel_size=4",
        "parallel.tensor_model_parallel_size=1",
        "train.global_batch_size=64",
        "train.micro_batch_size=8",  # 64 / (2 x 4)
        "train.lr=5e-07",
        "train.lr_warmup_iters=150",
        "train.clip_grad=10.0",
        # its example count, 64 per step, is a multiple of 20000 every 625 steps (40000)
        "train.sample_during_eval=false",
        "train.eval_interval=625",
        "checkpoint.save_interval=625",
        "train.eval_global_batch_size=32",
        "train.eval_iters=8",
        "train.eval_at_start=true",  # 256 / 32; do_first_eval
        "train.optimizer=adam",
        "train.adam_beta1=0.0",
        "train.adam_beta2=0.99",
        "run_dir=/runs/x",
    ]:
        assert want in o, want
    (rmsprop,) = [n for n in t.notes if n.startswith("optimizer=RMSprop")]
    assert "not available" in rmsprop and "used instead: Adam with beta1=0" in rmsprop
    assert any("the test split of Anthropic/hh-rlhf is the eval set" in n for n in t.notes)
    assert t.command()[:4] == [
        "bash",
        "scripts/pretrain_sft.sh",
        "--config",
        "configs/reference_dpo.yaml",
    ]


def test_dpo_ipo_and_conservative_losses():
    o = _translate(DPO_LINE).overrides
    assert {"loss=sigmoid", "loss.beta=0.1", "loss.label_smoothing=0.0"} <= set(o)
    assert _translate(DPO_LINE).script == "scripts/pretrain_dpo.sh"
    o = _translate([*DPO_LINE, "loss.label_smoothing=0.2", "loss.reference_free=true"]).overrides
    assert {"loss.label_smoothing=0.2", "loss.reference_free=true"} <= set(o)
    ipo = [w.replace("loss=dpo", "loss=ipo") for w in DPO_LINE]
    assert {"loss=ipo", "loss.beta=0.1", "loss.average_logps=false"} <= set(
        _translate(ipo).overrides
    )
    with pytest.raises(FrontendError, match="loss=dpo needs loss.beta"):
        _translate([w for w in DPO_LINE if not w.startswith("loss.beta")])
    with pytest.raises(FrontendError, match="the reference repo's losses are sft, dpo, ipo"):
        _translate([*DPO_LINE, "loss=kto"])


@pytest.mark.parametrize(
    "trainer,tp,pp,dp",
    [("BasicTrainer", 1, 2, 1), ("FSDPTrainer", 1, 1, 2), ("TensorParallelTrainer", 2, 1, 1)],
)
def test_trainers_as_layouts(trainer, tp, pp, dp):
    layout = layout_for(trainer, 2)
    assert (
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.data_parallel_size,
    ) == (tp, pp, dp)
    t = _translate([*SFT_LINE, f"trainer={trainer}"], devices=2)
    assert f"parallel.pipeline_model_parallel_size={pp}" in t.overrides
    assert any(n.startswith(f"trainer={trainer}: ") for n in t.notes)  # printed
    with pytest.raises(FrontendError, match="has BasicTrainer, FSDPTrainer, TensorParallelTrainer"):
        layout_for("DeepSpeedTrainer", 2)


def test_batch_errors_and_steps():
    with pytest.raises(
        FrontendError,
        match=r"batch_size=64 must be divisible by "
        r"gradient_accumulation_steps=2 x 3",
    ):
        _translate(SFT_LINE, devices=3)
    with pytest.raises(FrontendError, match="exp_name is required"):
        _translate([w for w in SFT_LINE if not w.startswith("exp_name")])
    with pytest.raises(FrontendError, match="model=blank_model needs model.name_or_path"):
        _translate([w for w in SFT_LINE if not w.startswith("model.name_or_path")])
    with pytest.raises(FrontendError, match="model=pythia6900: no such preset.*MODEL_PRESETS"):
        _translate([*SFT_LINE, "model=pythia6900"])
    # a reference name: the preset when MODEL_PRESETS has it, else its hub name
    from dpo_megatron.models.config import MODEL_PRESETS

    named = [w for w in SFT_LINE if not w.startswith("model")] + ["model=pythia69"]
    o = _translate(named).overrides
    assert (
        "model=pythia69" in o
        if "pythia69" in MODEL_PRESETS
        else "model.hf_path=EleutherAI/pythia-6.9b" in o
    )
    with pytest.raises(FrontendError, match="policy_dtype=float16.*use bfloat16"):
        _translate([*SFT_LINE, "model.policy_dtype=float16"])
    # full batches only: 10 items, batch 4 -> 2 per epoch; n_examples rounds up to whole batches
    t = Translation("s", [], "r", layout_for("BasicTrainer", 1), batch_size=4, epochs=3)
    assert steps_for(t, 10) == 6
    t.examples = 10
    assert steps_for(t, 10) == 3
    t.examples, t.epochs = None, 1
    with pytest.raises(FrontendError, match="3 training item"):
        steps_for(t, 3)


def test_every_reference_key_is_translated_or_noted():
    """Each key of the reference config, set away from its default, shows in the overrides or
    in a note: nothing is dropped silently."""
    changed = {
        "seed": 7,
        "batch_size": 8,
        "eval_batch_size": 4,
        "debug": "true",
        "fsdp_port": 1234,
        "wandb.enabled": "false",
        "wandb.entity": "me",
        "wandb.project": "p",
        "local_dirs": "[/tmp]",
        "sample_during_eval": "false",
        "n_eval_model_samples": 3,
        "do_first_eval": "false",
        "lr": 1e-4,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 3.0,
        "max_length": 64,
        "max_prompt_length": 32,
        "n_epochs": 2,
        "n_examples": 40,
        "n_eval_examples": 9,
        "trainer": "BasicTrainer",
        "optimizer": "AdamW",
        "warmup_steps": 5,
        "activation_checkpointing": "true",
        "eval_every": 64,
        "minimum_log_interval_secs": 2.0,
        "model.tokenizer_name_or_path": "/tok",
        "model.block_name": "GPTNeoXLayer",
        "model.policy_dtype": "bfloat16",
        "model.fsdp_policy_mp": "bfloat16",
        "model.reference_dtype": "bfloat16",
        "loss.label_smoothing": 0.1,
        "loss.reference_free": "true",
    }
    untested = (
        set(REFERENCE_DEFAULTS)
        - set(changed)
        - {
            "exp_name",
            "datasets",
            "model",
            "model.name_or_path",
            "model.archive",
            "loss",
            "loss.beta",
            "local_run_dir",
        }
    )
    assert not untested, untested
    t = _translate(DPO_LINE, extra=[f"{k}={v}" for k, v in changed.items()])
    text = " ".join(t.overrides) + " " + " ".join(t.notes)
    for token in [
        "train.seed=7",
        "data.seed=7",
        "debug=true",
        "fsdp_port=1234",
        "minimum_log_interval_secs=2.0",
        "train.lr=0.0001",
        "train.micro_batch_size=4",
        "train.clip_grad=3.0",
        "data.max_length=64",
        "data.max_prompt_length=32",
        "train.eval_num_samples=3",
        "train.weight_decay=0.01",
        "train.lr_warmup_iters=5",
        "model.recompute_granularity=full",
        "train.eval_interval=8",
        "train.eval_global_batch_size=4",
        "train.eval_iters=3",
        "train.eval_at_start=false",
        "data.tokenizer=/tok",
        "model.block_name=GPTNeoXLayer",
        "model.params_dtype=bfloat16",
        "model.fsdp_policy_mp=bfloat16",
        "loss.label_smoothing=0.1",
        "loss.reference_free=true",
    ]:
        assert token in text, token
    assert not any(o.startswith("logging.wandb") for o in t.overrides)
    assert (t.epochs, t.examples) == (2, 40)


def test_datasets_train_and_test_splits(tmp_path):
    """hh / shp evaluate on their hub test split, se (no test split on the hub) and a local file
    on nothing; a local folder with train and test files on its test files."""
    t = _translate([*DPO_LINE, "datasets=[hh,shp,se]"])
    assert {
        "data.datasets=[Anthropic/hh-rlhf,stanfordnlp/SHP,HuggingFaceH4/stack-exchange-preferences]",
        "data.eval_datasets=[Anthropic/hh-rlhf,stanfordnlp/SHP]",
        "data.eval_formats=[hh,shp]",
        "data.eval_split=test",
    } <= set(t.overrides)
    assert any(
        n.startswith(
            "datasets: se: no test split, no eval set from it (the reference repo evaluates on 1%"
        )
        for n in t.notes
    )
    assert any("shp_max_pairs_per_post=5" in n and "=0 for its exact set" in n for n in t.notes)
    hh = {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello.",
        "rejected": "\n\nHuman: Hi\n\nAssistant: No.",
    }
    folder = tmp_path / "hh"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps(hh) + "\n")
    t = _translate([*DPO_LINE, f"datasets=[{folder}]"])
    assert {
        f"data.datasets=[{folder}]",
        f"data.eval_datasets=[{folder}]",
        "data.truncation_mode=keep_end",
    } <= set(t.overrides)
    t = _translate([*DPO_LINE, f"datasets=[{folder / 'train.jsonl'}]"])
    assert not any(o.startswith("data.eval_datasets") for o in t.overrides)
    assert any(
        n.startswith(
            f"datasets: {folder / 'train.jsonl'}: no test split, no eval set "
            f"from it (a file is read whole"
        )
        for n in t.notes
    )
    assert any(n.startswith("no eval set: eval_every, eval_batch_size") for n in t.notes)
    assert not any(n.startswith("eval_batch_size=") for n in t.notes)
    assert "data.truncation_mode=keep_end" in t.overrides  # its rows are HH's


def test_the_readme_lines_dry_run_offline_and_a_real_run_stops_at_once(tmp_path):
    """The reference repo's two README lines as docs/COMING_FROM.md pastes them (a hub model
    preset, the hub HH dataset, a ``model.archive`` path that does not exist here), with
    ``--dry-run`` on a machine without the hub: the translation is printed, nothing is read
    (steps ``N``, noted; the archive noted, and it need not exist), the run goes to a visible
    ``runs/`` folder, not ``.cache/<user>`` inside the clone. Without ``--dry-run`` the pairs
    must be counted: one ``error:`` line naming both sources and the local alternatives, exit
    status 2, at once (no minute of hub retries first)."""
    import os
    import re
    import sys
    import time

    from dpo_megatron.frontends.common import ROOT

    with open(os.path.join(ROOT, "docs", "COMING_FROM.md"), encoding="utf-8") as f:
        lines = [
            line.split()[2:]
            for line in f.read().splitlines()
            if line.startswith("bash scripts/train_reference_style.sh model=")
        ]
    assert len(lines) == 2 and any(w.startswith("model.archive=") for w in lines[1])
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "DPO_MEGATRON_MODELS": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf"),
    }

    def run(*words):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "dpo_megatron.frontends.dpo_repo", *words],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc, time.monotonic() - started

    for words, script in zip(lines, ("pretrain_sft.sh", "pretrain_dpo.sh")):
        proc, _ = run("--dry-run", *words)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
        command = proc.stdout.split("translated command:\n")[1].strip()
        assert command.startswith(f"bash scripts/{script} --config configs/reference_dpo.yaml")
        assert command.endswith("train.train_iters=N")
        assert command.count("model.hf_path=") <= 1  # an archive's folder replaces the base's
        assert re.search(r"run_dir=runs/[^/ ]+/anthropic_dpo_pythia69_\S+ ", command), command
        assert (
            "note: train.train_iters=N: n_epochs=1 x (pairs left after preprocessing" in proc.stdout
        )
        assert not (tmp_path / ".cache").exists() and not (tmp_path / "runs").exists()
    assert "note: model.archive=/path/to/run/LATEST/policy.pt: converted to runs/" in proc.stdout
    proc, seconds = run(*lines[0])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert seconds < 15
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "EleutherAI/pythia-6.9b" in errors[0] and "Anthropic/hh-rlhf" in errors[0]
    assert "not reachable from here (offline)" in errors[0]
    assert "model.name_or_path=<HF folder>" in errors[0] and "datasets=[<local" in errors[0]


def test_a_failed_run_says_how_engine_keys_go_on_this_command_line(monkeypatch, capsys):
    """The engine's own messages name its keys (``data.on_error=skip``); the reference command
    line takes them as ``engine.data.on_error=skip``, and says so after a failed run."""
    from dpo_megatron.cli.dpo_repo import main
    from dpo_megatron.frontends import dpo_repo as frontend
    from dpo_megatron.frontends.dpo_repo import Layout

    t = Translation(
        script="scripts/pretrain_dpo.sh",
        overrides=["train.train_iters=1"],
        run_dir="/runs/x",
        layout=Layout(),
        steps=1,
    )
    monkeypatch.setattr(frontend, "prepare", lambda argv, **kw: t)
    for rc in (1, 0):
        monkeypatch.setattr(subprocess, "call", lambda cmd, rc=rc: rc)
        monkeypatch.setattr(frontend, "write_latest_archive", lambda *a: "/runs/x/LATEST")
        assert main(["loss=dpo"]) == rc
        err = capsys.readouterr().err
        assert ("with the prefix engine. (engine.data.on_error=skip)" in err) == (rc == 1), err


def test_an_engine_layout_override_is_named_beside_the_trainers_layout():
    t = _translate(
        DPO_LINE,
        devices=4,
        extra=[
            "engine.parallel.tensor_model_parallel_size=2",
            "engine.parallel.data_parallel_size=2",
        ],
    )
    assert t.overrides[-2:] == [
        "parallel.tensor_model_parallel_size=2",
        "parallel.data_parallel_size=2",
    ]
    assert (
        "engine.parallel.data_parallel_size, engine.parallel.tensor_model_parallel_size "
        "replace(s) the layout of trainer=FSDPTrainer above"
    ) in t.notes
    assert not any("replace(s) the layout" in n for n in _translate(DPO_LINE).notes)


def test_an_archive_replaces_the_base_models_folder_on_the_command():
    """``model.archive`` over ``model.name_or_path``: the command names one ``model.hf_path``
    (the archive's folder); the base's folder is kept for the archive's conversion."""
    t = _translate(DPO_LINE, extra=["model.archive=/r/LATEST/policy.pt"])
    assert [o for o in t.overrides if o.startswith("model.hf_path=")] == [
        f"model.hf_path={t.archive_dir}"
    ]
    assert t.base_model == "/m"


def test_an_engine_step_count_is_the_runs_step_count_neither_counted_nor_overridden(tmp_path):
    """``engine.train.train_iters=N`` is the run's step count: the n_epochs count (which reads
    the data) is not made, no ``train.train_iters`` follows it on the command, and LATEST's
    step count is N; a value that is not a whole number stops with one line."""
    from dpo_megatron.frontends.dpo_repo import prepare

    line = [w for w in DPO_LINE if not w.startswith("datasets")]
    unreadable = tmp_path / "pairs.jsonl"  # counting its pairs (with model /m) would fail
    unreadable.write_text("not JSON\n")
    argv = [*line, f"datasets=[{unreadable}]", "n_epochs=1", f"local_run_dir={tmp_path / 'run'}"]
    for dry in (True, False):
        t = prepare([*argv, "engine.train.train_iters=3"], devices=1, dry_run=dry)
        assert [o for o in t.overrides if o.startswith("train.train_iters=")] == [
            "train.train_iters=3"
        ]
        assert t.steps == 3
        assert "engine.train.train_iters=3: the step count given" in " ".join(t.notes)
    t = prepare(argv, devices=1, dry_run=True)
    assert t.overrides[-1] == "train.train_iters=N" and t.steps is None
    with pytest.raises(FrontendError, match=r"engine.train.train_iters=x: expected a whole"):
        prepare([*argv, "engine.train.train_iters=x"], devices=1, dry_run=True)


def test_a_pickled_policy_pt_stops_the_script_with_one_line_and_never_runs(tmp_path):
    """``scripts/train_reference_style.sh ... model.archive=policy.pt`` with a policy.pt whose
    pickle calls ``os.mkdir`` (torch 2.13 words its refusal of ``posix.*`` otherwise than of
    other globals; the verdict is read from the file's opcodes): one ``error:`` line that names
    the file and what it would call, exit status 2, no run folder, and the payload never ran."""
    import torch

    from tests.checkpointing.faults import Payload
    from tests.scripts import run_script

    marker, archive = tmp_path / "PAYLOAD_RAN", tmp_path / "policy.pt"
    torch.save({"step_idx": 0, "state": {"w": torch.zeros(2)}, "x": Payload(str(marker))}, archive)
    run_dir = tmp_path / "run"
    out = run_script(
        "scripts/train_reference_style.sh",
        *DPO_LINE,
        f"model.archive={archive}",
        f"local_run_dir={run_dir}",
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: model.archive={archive}: refused: the file holds a pickled object other than "
        "tensors and plain containers (dict, list, tuple, str, numbers): its pickle calls "
        "posix.mkdir, and loading it would run that code. Save only the state_dict "
        "(torch.save({'state': model.state_dict()}, path))"
    ]
    assert not marker.exists() and not run_dir.exists()
