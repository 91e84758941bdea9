"""Reference modes: precomputed (cached) and offloaded reference give the loss of ``model`` mode
(the precomputed values, grouped as the run groups its pairs, bit for bit: step-0 rewards exactly
0), the precomputed mode holds no reference model, and a table is never shared between runs whose
reference weights or grouping differ (another layout of random weights, another seed, packing)."""

import json
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dpo_megatron.data import PreferencePair
from dpo_megatron.training.config import ReferenceConfig
from dpo_megatron.training.reference import ReferenceTable, reference_cache_key
from tests.engine import (
    assert_step_zero_is_exact,
    step_record,
    tiny_pairs,
    tiny_trainer,
    train_step_against_reference,
    varied_lengths,
)
from tests.multirank import run_ranks


def test_table_round_trip(tmp_path):
    table = ReferenceTable(
        [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
        [torch.tensor([-3.0]), torch.tensor([-4.0, -5.0, -6.0])],
    )
    table.save(tmp_path / "t.pt")
    back = ReferenceTable.load(tmp_path / "t.pt")
    assert [t.tolist() for t in back.chosen] == [[-1.0, -2.0], [-0.5]]
    assert [t.tolist() for t in back.rejected] == [[-3.0], [-4.0, -5.0, -6.0]]


def test_table_attaches_to_its_pairs_and_refuses_stale_ones():
    pairs = [PreferencePair((5, 6), (7, 2), (8, 9, 2)), PreferencePair((5,), (7, 2), (2,))]
    table = ReferenceTable(
        [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])],
        [torch.tensor([-5.0, -6.0, -7.0]), torch.tensor([-8.0])],
    )
    carried = table.attach(pairs)
    assert carried[1].reference_rejected_logps.tolist() == [-8.0]
    assert carried == pairs  # the values are not part of a pair's identity
    with pytest.raises(ValueError, match="stale"):
        ReferenceTable(table.chosen, [torch.tensor([-5.0]), torch.tensor([-8.0])]).attach(pairs)
    with pytest.raises(ValueError, match="stale"):
        table.attach(pairs[:1])


def test_cache_key_follows_tokens_model_weights_and_layout():
    from dpo_megatron.models import ModelConfig

    pairs = [PreferencePair((5, 6), (7, 2), (8, 2))]
    layout = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    key = reference_cache_key(pairs, ModelConfig(), "w1", layout)
    assert key == reference_cache_key(list(pairs), ModelConfig(), "w1", dict(layout))
    assert key != reference_cache_key(
        [PreferencePair((5, 6), (7, 2), (9, 2))], ModelConfig(), "w1", layout
    )
    assert key != reference_cache_key(pairs, ModelConfig(num_layers=3), "w1", layout)
    assert key != reference_cache_key(pairs, ModelConfig(), "w2", layout)
    assert key != reference_cache_key(
        pairs, ModelConfig(), "w1", {**layout, "pipeline_model_parallel_size": 2}
    )
    assert key == reference_cache_key(pairs, ModelConfig(), "w1", layout, {})
    grouped = reference_cache_key(pairs, ModelConfig(), "w1", layout, {"steps": "a"})
    assert grouped not in (
        key,
        reference_cache_key(pairs, ModelConfig(), "w1", layout, {"steps": "b"}),
    )


def test_unknown_mode_is_rejected():
    known = "known: auto, model, precomputed"
    with pytest.raises(ValueError, match=f"reference.mode='cached'; {known}"):
        ReferenceConfig(mode="cached").validate()


def _trajectories(cache_dir, steps=3):
    """Loss trajectories of the real trainer in every reference mode, and how many reference
    passes (schedule calls) each ran during set-up and during training."""
    import dpo_megatron.training.step as step_module

    calls = []
    original = step_module.reference_token_logps
    step_module.reference_token_logps = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    runs = {
        "model": ("model", False, False),
        "precomputed": ("precomputed", False, False),
        "precomputed_again": ("precomputed", False, False),
        "precomputed_packed": ("precomputed", False, True),
        "offload": ("model", True, False),
    }
    out = {}
    for name, (mode, offload, packed) in runs.items():
        calls.clear()
        trainer = tiny_trainer(
            tiny_pairs(6, seed=9, lengths=varied_lengths),
            eval_pairs=tiny_pairs(2, seed=1, lengths=varied_lengths),
            model={"num_layers": 2},
            reference_mode=mode,
            offload=offload,
            cache_dir=cache_dir,
            packing=packed,
            seed=3,
            micro_batch_size=2,
            global_batch_size=6,
            steps=steps,
            lr=1e-2,
            loss={"name": "sigmoid", "beta": 0.5},
        )
        before_training = len(calls)
        step0 = step_record(*train_step_against_reference(trainer))
        losses = [step0["metrics"]["loss"]]
        losses += [trainer.train_step()[0].metrics["loss"] for _ in range(steps - 1)]
        evaluation = trainer.evaluate(steps)["loss"]
        out[name] = {
            "step0": step0,
            "losses": losses,
            "eval": evaluation,
            "precompute_calls": before_training,
            "training_calls": len(calls) - before_training,
            "reference_held": trainer.reference is not None,
        }
    return out


def test_precomputed_and_offload_give_the_model_mode_loss(tmp_path):
    out = run_ranks(_trajectories, world_size=1, cache_dir=str(tmp_path))[0]
    want = out["model"]["losses"]
    for name in ("precomputed", "precomputed_again", "precomputed_packed", "offload"):
        for a, b in zip(out[name]["losses"], want, strict=True):
            assert abs(a - b) < 1e-5, (name, out[name]["losses"], want)
        assert abs(out[name]["eval"] - out["model"]["eval"]) < 1e-5, name
    # Step 0: the policy's log-probs are the reference's bit for bit in every mode (the
    # precomputed values were computed on the very micro-batches step 0 runs).
    for name, run in out.items():
        assert_step_zero_is_exact(run["step0"])
        assert run["losses"][0] == float(-torch.nn.functional.logsigmoid(torch.zeros(()))), name
    # model mode: one reference pass per training step and one for the evaluation.
    assert out["model"]["training_calls"] == 3 + 1 and out["model"]["reference_held"]
    # precomputed: the first epoch's one train step (its 3 micro-batches in one pass) + the one
    # eval step before training, none after, and no reference model held.
    assert out["precomputed"]["precompute_calls"] == 1 + 1
    assert out["precomputed"]["training_calls"] == 0
    assert not out["precomputed"]["reference_held"]
    # The second run with the same weights, layout, data and grouping reads the cache: no pass.
    assert out["precomputed_again"]["precompute_calls"] == 0
    assert out["precomputed_again"]["training_calls"] == 0
    # train + eval tables, padded and packed (rows grouped otherwise: a table of their own).
    assert len(list(tmp_path.glob("reference-*.pt"))) == 4


def _step_one_loss(cache_dir, pp):
    trainer = tiny_trainer(
        tiny_pairs(8, seed=9, lengths=varied_lengths),
        pp=pp,
        reference_mode="precomputed",
        cache_dir=cache_dir,
        seed=5,
        micro_batch_size=2,
        global_batch_size=4,
        steps=1,
    )
    return trainer.train_step()[0].metrics["loss"]


@pytest.mark.slow
def test_random_init_runs_at_two_layouts_never_share_a_table(tmp_path):
    """Defect: random weights are drawn per pipeline stage, so PP 1 and PP 2 runs of one seed
    have different references; the cache once served the PP 1 table to the PP 2 run (step-1 loss
    0.696575 instead of ln 2)."""
    cache = str(tmp_path)
    assert (
        abs(run_ranks(_step_one_loss, world_size=1, cache_dir=cache, pp=1)[0] - math.log(2)) < 1e-6
    )
    losses = run_ranks(_step_one_loss, world_size=2, cache_dir=cache, pp=2)
    assert all(abs(loss - math.log(2)) < 1e-6 for loss in losses)
    assert len(list(tmp_path.glob("reference-*.pt"))) == 2


# ----------------------------------------------------------------------------------------------
# a reference of its own: reference.hf_path / reference.load

BASE = ["data.tokenizer=t", "data.path=d.json"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["lora.enabled=true", "reference.hf_path=/sft"],
            "reference.hf_path=/sft with lora.enabled=true: a LoRA run's reference is the "
            "policy's own base with the adapters off",
        ),
        (
            ["reference.hf_path=/sft", "reference.load=/ckpt"],
            "reference.hf_path=/sft and reference.load=/ckpt: the reference has one source",
        ),
        (
            ["loss.name=simpo", "reference.load=/ckpt"],
            "reference.load=/ckpt, but loss.name=simpo reads no reference model: drop "
            "reference.load",
        ),
        (  # how the log-probs are obtained, for a loss without them: ignored, so refused
            ["loss.name=orpo", "reference.mode=precomputed"],
            "reference.mode=precomputed, but loss.name=orpo reads no reference model: drop "
            "reference.mode",
        ),
        (
            ["loss.name=sft", "reference.offload=true"],
            "reference.offload=true, but loss.name=sft reads no reference model: drop "
            "reference.offload",
        ),
    ],
)
def test_a_reference_of_its_own_is_refused_where_it_cannot_work(overrides, message):
    from dpo_megatron.config import load_config

    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, BASE + overrides)


def test_a_reference_of_another_shape_or_no_causal_lm_is_refused_naming_both(tmp_path):
    """The launchers' pre-check (``reference_model_config``) reads config.json or the
    checkpoint's records only: another architecture names both sources and every field that
    differs; a truncated weights file of the reference folder is named, as the policy's would
    be; a folder that is no checkpoint, and a LoRA checkpoint (adapters, no base weights), are
    refused by name."""
    from dpo_megatron.cli.check import main
    from dpo_megatron.config import load_config
    from dpo_megatron.training.run_models import reference_model_config, resolve_model_config
    from tests.models.conversion_helpers import save_tiny_hf_folder
    from tests.training.test_lifecycle import fixture_data_overrides, write_fixture

    policy = save_tiny_hf_folder("llama", str(tmp_path / "policy"))
    same = save_tiny_hf_folder("llama", str(tmp_path / "same"), seed=1)
    other = save_tiny_hf_folder(
        "llama", str(tmp_path / "other"), seed=1, hidden_size=32, num_hidden_layers=2
    )

    def check(*overrides):
        cfg = load_config(None, ["data.path=d.json", f"model.hf_path={policy}", *overrides])
        return reference_model_config(cfg.reference, resolve_model_config(cfg), seed=cfg.train.seed)

    assert check() is None  # the policy's starting weights
    assert check(f"reference.hf_path={same}").hf_path == same
    data_file, tok_dir = write_fixture(tmp_path / "data", rows=4)
    with pytest.raises(SystemExit) as stop:  # the launchers' pre-check: one line, exit 1
        main(
            [f"run_dir={tmp_path / 'run'}", f"model.hf_path={policy}"]
            + fixture_data_overrides(data_file, tok_dir)
            + [f"reference.hf_path={other}"]
        )
    assert str(stop.value) == (
        f"config error: reference.hf_path={other} holds a model with num_layers=2, "
        f"hidden_size=32, kv_channels=8, but the policy (Hugging Face folder {policy}) has "
        "num_layers=4, hidden_size=64, kv_channels=16: the reference must be the policy's "
        "architecture, with other weights"
    )
    broken = tmp_path / "broken"  # the reference's weight files are checked as the policy's
    shutil.copytree(same, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SystemExit) as stop:
        main(
            [f"run_dir={tmp_path / 'run'}", f"model.hf_path={policy}"]
            + fixture_data_overrides(data_file, tok_dir)
            + [f"reference.hf_path={broken}"]
        )
    assert str(stop.value).startswith("config error: ") and str(weights) in str(stop.value)
    not_checkpoint = tmp_path / "empty"
    not_checkpoint.mkdir()
    with pytest.raises(
        FileNotFoundError,
        match="reference.load=.*empty: not a megatron-core distributed checkpoint "
        r"\(no metadata.json there\)",
    ):
        check(f"reference.load={not_checkpoint}")
    adapters = tmp_path / "lora_ckpt"
    adapters.mkdir()
    (adapters / "metadata.json").write_text("{}")
    (adapters / "train_state.json").write_text(json.dumps({"lora": {"base": policy}}))
    with pytest.raises(ValueError, match="reference.load=.*lora_ckpt is a LoRA checkpoint"):
        check(f"reference.load={adapters}")


def _transformers_logps(hf_dir: str, pairs) -> dict[str, list[float]]:
    """transformers' (fp32) summed completion log-probs of each pair under ``hf_dir``'s model."""
    from transformers import AutoModelForCausalLM

    from tests.models.conversion_helpers import completion_logps

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return completion_logps(model, pairs)


@pytest.mark.slow
def test_a_reference_of_its_own_through_the_launcher_with_a_save_and_a_resume(tmp_path):
    """Policy A, reference B: two tiny random Llama folders. Run 1 (TP 2, reference.hf_path=B,
    the reference model every step) saves after each step; its step-1 rewards are transformers'
    log-ratios, beta x (log p_A - log p_B) summed over completion tokens, averaged over the
    pairs. Run 2 resumes run 1's step-1 checkpoint at PP 2 with the same reference from a
    checkpoint (reference.load, converted from B at TP 1: resharded) and precomputed: its step 2
    is run 1's step 2 (1e-5), which a reference equal to the policy's start would not give."""
    from dpo_megatron.config import load_config
    from dpo_megatron.data import load_tokenizer
    from dpo_megatron.data.pipeline import load_items
    from tests.models.conversion_helpers import save_tiny_hf_folder
    from tests.scripts import ROOT, launcher_env, run_script
    from tests.training.test_lifecycle import fixture_data_overrides, read_metrics, write_fixture

    beta = 0.1
    data_file, tok_dir = write_fixture(tmp_path / "data", rows=4, seed=2)
    policy = save_tiny_hf_folder("llama", str(tmp_path / "A"), seed=0, vocab_size=400)
    reference = save_tiny_hf_folder("llama", str(tmp_path / "B"), seed=1, vocab_size=400)
    converted = subprocess.run(
        [sys.executable, "scripts/convert_hf_to_megatron.py", "--hf-path", reference]
        + ["--save", str(tmp_path / "B_ckpt")],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert converted.returncode == 0, converted.stderr[-3000:]
    config = tmp_path / "run.yaml"  # the package defaults (one rank, no eval split) and DPO
    config.write_text(f"loss:\n  name: sigmoid\n  beta: {beta}\n")
    common = [
        f"model.hf_path={policy}",
        *fixture_data_overrides(data_file, tok_dir),
        "train.micro_batch_size=1",
        "train.global_batch_size=4",  # every pair at every step
        "train.train_iters=2",
        "train.lr=1e-3",
        "checkpoint.save_interval=1",
        "logging.tensorboard=false",
    ]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    out = run_script(
        "scripts/pretrain_dpo.sh",
        "--config",
        str(config),
        *common,
        f"run_dir={first}",
        f"reference.hf_path={reference}",
        "reference.mode=model",
        "parallel.tensor_model_parallel_size=2",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"reference: Hugging Face folder {reference}" in out.stdout
    out = run_script(
        "scripts/pretrain_dpo.sh",
        "--config",
        str(config),
        *common,
        f"run_dir={resumed}",
        f"checkpoint.resume={first}/checkpoints/iter_0000001",
        f"reference.load={tmp_path / 'B_ckpt'}",
        "reference.mode=precomputed",
        f"reference.cache_dir={tmp_path / 'cache'}",
        "parallel.pipeline_model_parallel_size=2",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"reference: checkpoint {tmp_path / 'B_ckpt'}" in out.stdout

    cfg = load_config(str(config), common)
    pairs = load_items(cfg.data, load_tokenizer(tok_dir), "pairs").train
    assert len(pairs) == 4
    under_a = _transformers_logps(policy, pairs)
    under_b = _transformers_logps(reference, pairs)
    step1 = read_metrics(first)[1]
    for side in ("chosen", "rejected"):
        a, b = under_a[side], under_b[side]
        want = sum(beta * (x - y) for x, y in zip(a, b)) / len(a)
        # the summed log-probs are each within 1e-5 relative of transformers'
        bound = sum(beta * 1e-5 * (abs(x) + abs(y)) for x, y in zip(a, b)) / len(a)
        assert abs(step1[f"rewards/{side}"] - want) <= bound, (side, step1, want)
        assert abs(want) > 100 * bound  # the two models differ: a ratio far from 0
    step2, again = read_metrics(first)[2], read_metrics(resumed)
    assert sorted(again) == [2]
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"):
        assert again[2][key] == pytest.approx(step2[key], rel=1e-5), key


def test_cache_key_follows_the_weights_dtype_and_the_device(monkeypatch):
    """A bf16 checkpoint's values are the same numbers in an fp32 and a bf16 model
    (``model.params_dtype=auto`` is either, by device), and the same weights give other last
    bits on another device: neither may share a table. The fingerprint hashed only the values
    and the key no device, so a bf16 run read an fp32 run's table (step-0 rewards not 0)."""
    import copy

    import dpo_megatron.training.reference as reference
    from dpo_megatron.models import ModelConfig
    from dpo_megatron.training.reference import weights_fingerprint

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())  # values that bf16 holds exactly
        layer.bias.copy_(layer.bias.bfloat16().float())
    fp32 = weights_fingerprint([layer])
    assert fp32 == weights_fingerprint([copy.deepcopy(layer)])
    assert weights_fingerprint([layer.to(torch.bfloat16)]) != fp32

    pairs = [PreferencePair((5, 6), (7, 2), (8, 2))]
    layout = {"tensor_model_parallel_size": 1}
    monkeypatch.setattr(reference, "get_device", lambda: torch.device("cpu"))
    on_cpu = reference_cache_key(pairs, ModelConfig(), "w1", layout)
    monkeypatch.setattr(reference, "get_device", lambda: torch.device("cuda", 0))
    assert reference_cache_key(pairs, ModelConfig(), "w1", layout) != on_cpu
