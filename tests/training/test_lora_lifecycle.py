"""LoRA run lifecycle through ``dpo_megatron.cli.train.train``: exact resume from an adapter-only
checkpoint, resharding it to another layout, refusing checkpoints that do not fit, and the PEFT
export at the end. Tiny random model, tiny tokenizer, fixture data (``test_lifecycle``'s)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.training.test_lifecycle import (
    model_tensors,
    read_metrics,
    run_train,
    write_fixture,
)

pytestmark = pytest.mark.slow

LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8"]
COMMON = [*LORA, "train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last_n=0"]


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("lora_lifecycle_data"))


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, fixture_files):
    """4 LoRA steps at TP 2 with the distributed optimizer, checkpoints at steps 2 and 4."""
    data_file, tok_dir = fixture_files
    run_dir = tmp_path_factory.mktemp("lora_runs") / "full"
    run_train(
        run_dir, data_file, tok_dir, *COMMON, "checkpoint.export_hf=adapter", world_size=2, tp=2
    )
    return run_dir


def test_resume_is_exact_and_the_checkpoint_holds_only_adapters(
    tmp_path, straight_run, fixture_files
):
    data_file, tok_dir = fixture_files
    resumed = tmp_path / "resumed"
    shutil.copytree(straight_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "iter_0000004")
    run_train(resumed, data_file, tok_dir, *COMMON, "checkpoint.resume=auto", world_size=2, tp=2)
    a, b = read_metrics(straight_run), read_metrics(resumed)
    assert abs(a[1]["loss"] - 0.6931471805599453) < 1e-6  # step 0: policy == base
    for step in (3, 4):  # bit-identical after the resume
        assert b[step]["loss"] == a[step]["loss"], step
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step
    assert a[4]["loss"] < a[1]["loss"]
    # The export is said, with its folder, and the end-of-run summary points at it.
    folder = straight_run / "checkpoints" / "hf_adapter"
    what = (
        f"LoRA adapter in bfloat16 (PEFT: peft.PeftModel.from_pretrained(base, folder)) -> {folder}"
    )
    log = (straight_run / "train.log").read_text().splitlines()
    assert f"exported the {what}" in log and f"  export: {what}" in log

    ckpt = straight_run / "checkpoints" / "iter_0000004"
    tensors = model_tensors(ckpt)
    assert tensors and all("_lora.lora_" in k for k in tensors), sorted(tensors)[:4]
    assert len(tensors) == 8  # 4 targets x (A, B), all layers stacked per key
    assert_same = model_tensors(resumed / "checkpoints" / "iter_0000004")
    assert all((tensors[k] == assert_same[k]).all() for k in tensors)
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["lora"]["rank"] == 4 and state["lora"]["alpha"] == 8.0
    assert state["lora"]["base"].startswith("random initialisation")  # the base's source
    # Optimizer state of the adapters is in the checkpoint too (distributed optimizer).
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer") and "_lora.lora_" in k for k in keys)
    # Exactly the adapters' values: per layer qkv A [4, 64] + B [128, 4], proj 2 x [4, 64],
    # fc1 A [4, 64] + B [256, 4], fc2 A [4, 128] + B [64, 4] = 3,328; the base has ~199k.
    assert sum(v.size for v in tensors.values()) == 4 * 3328


def test_resume_reshards_to_another_layout(tmp_path, straight_run, fixture_files):
    """Saved at TP 2, resumed at TP 1 (random base weights are drawn TP-independently on the
    CPU, so the base is the same): the same steps within fp32 reduction-order noise."""
    data_file, tok_dir = fixture_files
    resumed = tmp_path / "tp1"
    shutil.copytree(straight_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "iter_0000004")
    run_train(resumed, data_file, tok_dir, *COMMON, "checkpoint.resume=auto")
    a, b = read_metrics(straight_run), read_metrics(resumed)
    for step in (3, 4):
        assert abs(b[step]["loss"] - a[step]["loss"]) < 1e-5 * abs(a[step]["loss"])
        assert abs(b[step]["grad_norm"] - a[step]["grad_norm"]) < 1e-5 * a[step]["grad_norm"]


def test_checkpoints_that_do_not_fit_are_refused(tmp_path, straight_run, fixture_files):
    data_file, tok_dir = fixture_files
    ckpt = str(straight_run / "checkpoints" / "iter_0000002")
    with pytest.raises(RuntimeError, match="is a LoRA checkpoint: it holds adapters, not base"):
        run_train(tmp_path / "a", data_file, tok_dir, f"model.load={ckpt}", "train.train_iters=1")
    with pytest.raises(RuntimeError, match="holds LoRA adapters .*lora.enabled=False"):
        run_train(
            tmp_path / "b", data_file, tok_dir, f"checkpoint.resume={ckpt}", "train.train_iters=3"
        )
    with pytest.raises(RuntimeError, match="holds other LoRA adapters: {'rank': \\(4, 8\\)}"):
        run_train(
            tmp_path / "c",
            data_file,
            tok_dir,
            *LORA,
            "lora.rank=8",
            f"checkpoint.resume={ckpt}",
            "train.train_iters=3",
        )


def test_adapter_export_at_the_end(straight_run):
    from safetensors.torch import load_file

    folder = straight_run / "checkpoints" / "hf_adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == sorted(
        [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ]
    )
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert len(tensors) == 4 * 7 * 2  # layers x HF modules x (A, B)
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert list(a.shape) == [4, 64] and list(b.shape) == [64, 4] and b.abs().sum() > 0


def test_the_converter_writes_the_adapter_the_run_exported(tmp_path, straight_run):
    """``convert_megatron_to_hf.py --adapter`` on the run's last (adapter-only) checkpoint, at
    another layout than the run's (PP 2 against TP 2) and without the base (randomly
    initialised here), writes the PEFT folder the run wrote at its end: the same config and the
    same tensors, bit for bit."""
    from safetensors.torch import load_file

    from tests.checkpointing.test_model_checkpoint import _run_script
    from tests.multirank import run_ranks

    out = tmp_path / "adapter"
    run_ranks(
        _run_script,
        world_size=2,
        name="convert_megatron_to_hf",
        argv=["--load", str(straight_run / "checkpoints"), "--save", str(out), "--adapter"]
        + ["--pipeline-model-parallel-size", "2"],
    )
    exported = straight_run / "checkpoints" / "hf_adapter"
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (exported / "adapter_config.json").read_text()
    )
    ours = load_file(str(out / "adapter_model.safetensors"))
    theirs = load_file(str(exported / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 4 * 7 * 2
    assert all(ours[k].dtype == theirs[k].dtype and torch_equal(ours[k], theirs[k]) for k in ours)


def test_merged_export_and_the_converter_agree_on_a_lora_checkpoint(tmp_path, fixture_files):
    """A LoRA run on an HF base exports merged at the end (``export_hf=true``: the boolean
    keeps its meaning); ``convert_megatron_to_hf.py`` on its adapter-only checkpoint reloads
    the base from the recorded ``hf_path``, merges the same adapters and writes the same
    tensors, at another layout."""
    from safetensors.torch import load_file

    from tests.checkpointing.test_model_checkpoint import _run_script
    from tests.models.conversion_helpers import save_tiny_hf_folder
    from tests.multirank import run_ranks

    data_file, tok_dir = fixture_files
    hf_dir = save_tiny_hf_folder(
        "llama", str(tmp_path / "hf"), vocab_size=400, max_position_embeddings=128
    )
    run_dir = tmp_path / "run"
    run_train(
        run_dir,
        data_file,
        tok_dir,
        *LORA,
        f"model.hf_path={hf_dir}",
        "train.train_iters=2",
        "train.lr=1e-2",
        "checkpoint.export_hf=true",
        "checkpoint.export_dtype=float32",
        world_size=2,
        tp=2,
    )
    trained = load_file(str(run_dir / "checkpoints" / "hf" / "model-00001-of-00001.safetensors"))
    base = load_file(str(tmp_path / "hf" / "model.safetensors"))
    changed = [k for k in base if not torch_equal(base[k], trained[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # adapted layers only
    out = str(tmp_path / "converted")
    run_ranks(
        _run_script,
        world_size=2,
        name="convert_megatron_to_hf",
        argv=[
            "--load",
            str(run_dir / "checkpoints"),
            "--save",
            out,
            "--dtype",
            "float32",
            "--pipeline-model-parallel-size",
            "2",
        ],
    )
    converted = load_file(str(tmp_path / "converted" / "model-00001-of-00001.safetensors"))
    assert sorted(converted) == sorted(trained)
    for k in trained:  # merged at TP 2 in training, at PP 2 by the converter
        assert (converted[k] - trained[k]).abs().max() <= 1e-6 * trained[k].abs().max(), k


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _lora_run_under_host_check(root):
    from dpo_megatron.training.trainer import Trainer
    from tests.host_tensors import HostTensorCheck
    from tests.training.test_device_boundary import _config

    reports = {}
    for name, overrides in {"model": [], "precomputed": ["reference.mode=precomputed"]}.items():
        with HostTensorCheck() as check:
            Trainer(
                _config(
                    root,
                    name,
                    *LORA,
                    "parallel.tensor_model_parallel_size=2",
                    "parallel.pipeline_model_parallel_size=2",
                    "checkpoint.export_hf=adapter",
                    *overrides,
                )
            ).train()
        reports[name] = check.report()
    return reports


def test_a_lora_run_leaves_no_tensor_on_the_host(tmp_path):
    """Adapters, the adapters-off reference pass (and its precompute), evaluation with samples,
    the adapter checkpoint and the PEFT export at TP 2 x PP 2: nothing made on the host."""
    from tests.multirank import run_ranks

    for rank, reports in enumerate(
        run_ranks(_lora_run_under_host_check, world_size=4, root=str(tmp_path))
    ):
        for name, report in reports.items():
            assert report == "", f"rank {rank}, {name} run:\n{report}"
