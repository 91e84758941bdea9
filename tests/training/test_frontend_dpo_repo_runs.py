"""The reference DPO repo's two README lines, end to end: pasted as they are (``model=``
a tiny GPT-2-style HF folder through ``model=blank_model model.name_or_path``, ``datasets=`` a local
HH-format file, since the machines are offline), run SFT and then DPO from the SFT's
``LATEST/policy.pt`` on our engine through ``scripts/train_reference_style.sh``; each prints its
translated command, DPO starts at ln 2, and the printed DPO command run directly gives the same
per-step losses."""

import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch

from tests.data.fixtures import tiny_hf_tokenizer
from tests.models.conversion_helpers import save_tiny_hf_folder
from tests.training.test_lifecycle import read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_LINE = (
    "python -u train.py model=pythia69 datasets=[hh] loss=sft "
    "exp_name=anthropic_dpo_pythia69 gradient_accumulation_steps=2 batch_size=64 "
    "eval_batch_size=32 trainer=FSDPTrainer sample_during_eval=false"
)
DPO_LINE = (
    "python -u train.py model=pythia69 datasets=[hh] loss=dpo loss.beta=0.1 "
    "model.archive=/path/to/checkpoint/from/sft/step-XXXX/policy.pt "
    "exp_name=anthropic_dpo_pythia69 gradient_accumulation_steps=2 batch_size=32 "
    "eval_batch_size=32 trainer=FSDPTrainer sample_during_eval=false"
)
# The repo's default lr (5e-7 with 150 warm-up steps) would leave a two-step run's weights where
# they started; a larger constant lr makes the SFT weights and the DPO steps differ.
MOVE = ["lr=1e-3", "warmup_steps=0"]


def _words(line, model_dir, data_file, run_dir, archive=None):
    words = shlex.split(line)[3:]  # drop "python -u train.py"
    out = []
    for w in words:
        if w.startswith("model="):
            w = f"model=blank_model model.name_or_path={model_dir}"
        elif w.startswith("datasets="):
            w = f"datasets=[{data_file}]"
        elif w.startswith("model.archive="):
            w = f"model.archive={archive}"
        out += w.split(" ")
    return [*out, f"local_run_dir={run_dir}", *MOVE]


def _env(tmp_path):
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        DPO_MEGATRON_CACHE=str(tmp_path / "cache"),
        OMP_NUM_THREADS="1",
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(cmd, env, cwd=ROOT):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _printed_command(stdout):
    lines = stdout.splitlines()
    return lines[lines.index("translated command:") + 1].strip()


def _losses(run_dir):
    return [m["loss"] for _, m in sorted(read_metrics(run_dir).items())]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_cli")
    tok = tiny_hf_tokenizer()
    model_dir = save_tiny_hf_folder(
        "gpt2",
        str(root / "tiny"),
        vocab_size=400,
        n_positions=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    tok.save_pretrained(model_dir)
    words = ["blue", "green", "sky", "grass", "fine", "yes", "no", "hello"]
    with open(root / "hh.jsonl", "w") as f:
        for i in range(64):  # 64 pairs: one SFT step of batch 64, two DPO steps of 32
            prompt = f"\n\nHuman: What colour is the {words[i % 8]}?\n\nAssistant:"
            if i % 5 == 0:  # a multi-turn dialogue
                prompt = f"\n\nHuman: Hello!\n\nAssistant: Hello, how are you?{prompt}"
            f.write(
                json.dumps(
                    {
                        "chosen": prompt + f" It is {words[(i + 1) % 8]}.",
                        "rejected": prompt + f" {words[(i + 3) % 8]} no.",
                    }
                )
                + "\n"
            )
    return model_dir, str(root / "hh.jsonl")


def test_reference_readme_lines_sft_then_dpo(tmp_path, tiny_files):
    model_dir, data_file = tiny_files
    env = _env(tmp_path)
    script = [os.path.join(ROOT, "scripts", "train_reference_style.sh")]
    sft_dir, dpo_dir, direct_dir = (str(tmp_path / n) for n in ("sft", "dpo", "direct"))

    sft_out = _run(["bash", *script, *_words(SFT_LINE, model_dir, data_file, sft_dir)], env)
    sft_cmd = _printed_command(sft_out)
    assert sft_cmd.startswith("bash scripts/pretrain_sft.sh --config configs/reference_dpo.yaml")
    for want in (
        "loss=sft",
        "train.global_batch_size=64",
        "train.micro_batch_size=32",
        "parallel.data_parallel_size=1",
        "train.train_iters=1",
    ):
        assert want in sft_cmd.split(), want
    assert "note: trainer=FSDPTrainer: 1 FSDP replica(s) -> data parallel 1" in sft_out
    archive = os.path.join(sft_dir, "LATEST", "policy.pt")
    blob = torch.load(archive, weights_only=True)
    assert blob["step_idx"] == 64 and set(blob) == {"step_idx", "state", "metrics"}
    from safetensors.torch import load_file

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    assert any(not torch.equal(base[k], blob["state"][k]) for k in base)  # SFT moved the weights

    dpo_out = _run(
        ["bash", *script, *_words(DPO_LINE, model_dir, data_file, dpo_dir, archive=archive)], env
    )
    dpo_cmd = _printed_command(dpo_out)
    assert dpo_cmd.startswith("bash scripts/pretrain_dpo.sh --config configs/reference_dpo.yaml")
    assert f"model.hf_path={dpo_dir}/archive_hf" in dpo_cmd.split()
    assert "train.train_iters=2" in dpo_cmd.split()
    losses = _losses(dpo_dir)
    assert len(losses) == 2
    assert abs(losses[0] - math.log(2)) < 1e-6  # policy and reference both start from policy.pt
    assert abs(losses[1] - math.log(2)) > 1e-4  # and it trains
    assert os.path.exists(os.path.join(dpo_dir, "LATEST", "policy.pt"))

    # the printed command, run directly (into its own run_dir), trains the same steps
    _run([*shlex.split(dpo_cmd), f"run_dir={direct_dir}"], env)
    direct = _losses(direct_dir)
    assert direct == pytest.approx(losses, abs=1e-6), (direct, losses)


def _train_translated(config, overrides):
    from dpo_megatron.cli.train import train
    from dpo_megatron.config import load_config

    return train(load_config(os.path.join(ROOT, config), overrides))


def test_hh_folder_test_split_is_the_eval_set(tmp_path, tiny_files):
    """``datasets=[folder]`` with train.jsonl (8 pairs) and test.jsonl (5 rows, one with chosen
    == rejected): the translated run trains on the 8 train pairs (2 steps of batch_size=4) and
    evaluates, before the first step (do_first_eval) and after step 2 (eval_every=8 examples),
    on the 4 kept test pairs in batches of eval_batch_size=3 (3 + 1); at step 0 the policy is the
    reference, so the eval loss is ln 2 exactly. With n_eval_examples=3 one batch of 3 is read."""
    from dpo_megatron.frontends.dpo_repo import prepare
    from tests.multirank import run_ranks

    model_dir, _ = tiny_files
    folder = tmp_path / "hh"
    folder.mkdir()

    def dialogue(i, answer):
        return f"\n\nHuman: Is {i} a number?\n\nAssistant: {answer}"

    def write(name, rows):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(
        "train.jsonl",
        [{"chosen": dialogue(i, "Yes."), "rejected": dialogue(i, "No.")} for i in range(8)],
    )
    write(
        "test.jsonl",
        [{"chosen": dialogue(i, "Yes, it is."), "rejected": dialogue(i, "No.")} for i in range(4)]
        + [{"chosen": dialogue(9, "Yes."), "rejected": dialogue(9, "Yes.")}],
    )
    argv = [
        "model=blank_model",
        f"model.name_or_path={model_dir}",
        f"datasets=[{folder}]",
        "loss=dpo",
        "loss.beta=0.1",
        "exp_name=eval_split",
        "batch_size=4",
        "gradient_accumulation_steps=2",
        "eval_batch_size=3",
        "eval_every=8",
        "sample_during_eval=false",
        "wandb.enabled=false",
        f"local_run_dir={tmp_path / 'run'}",
        f"engine.data.cache_dir={tmp_path / 'cache'}",
        *MOVE,
    ]
    t = prepare(argv, devices=1)
    assert {
        f"data.eval_datasets=[{folder}]",
        "data.eval_split=test",
        "train.eval_interval=2",
        "train.eval_global_batch_size=3",
        "train.eval_at_start=true",
        "train.train_iters=2",
    } <= set(t.overrides)
    run_ranks(_train_translated, world_size=1, config=t.config, overrides=t.overrides)
    evals = read_metrics(tmp_path / "run", "eval")
    assert sorted(evals) == [0, 2] and sorted(read_metrics(tmp_path / "run")) == [1, 2]
    assert [evals[s]["items"] for s in (0, 2)] == [4, 4]  # the test pairs, not the 8 train ones
    assert abs(evals[0]["loss"] - math.log(2)) < 1e-6 and evals[0]["rewards/margins"] == 0.0
    assert abs(evals[2]["loss"] - math.log(2)) > 1e-4  # after two steps

    t = prepare(
        [
            *argv,
            "n_eval_examples=3",
            "do_first_eval=false",
            "n_examples=4",
            f"local_run_dir={tmp_path / 'run3'}",
        ],
        devices=1,
    )
    run_ranks(_train_translated, world_size=1, config=t.config, overrides=t.overrides)
    evals = read_metrics(tmp_path / "run3", "eval")
    assert sorted(evals) == [1] and evals[1]["items"] == 3  # the last step only, one batch of 3
