"""Model-only distributed checkpoints: save at one layout, load at another, atomically."""

import os

import pytest
import torch

from tests.models.conversion_helpers import (
    build_tiny_hf_model,
    pipeline_logits,
    save_tiny_hf_folder,
)
from tests.multirank import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(hf_dir, tp, pp, vpp=None):
    from dpo_megatron.models import ModelConfig, build_model_chunks, model_config_from_hf
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    initialize_distributed(parallel)
    set_seed(99)
    cfg = model_config_from_hf(
        hf_dir, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    return cfg, build_model_chunks(cfg, parallel)


def _save(hf_dir, ckpt, tp, pp, vpp=None):
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import load_hf_weights

    cfg, chunks = _build(hf_dir, tp, pp, vpp)
    load_hf_weights(chunks, cfg, hf_dir)
    save_model_checkpoint(chunks, ckpt, cfg)


def _load_forward(hf_dir, ckpt, tp, pp, input_ids):
    from dpo_megatron.checkpointing import load_model_checkpoint

    _, chunks = _build(hf_dir, tp, pp)
    load_model_checkpoint(chunks, ckpt)
    return pipeline_logits(chunks, input_ids)


def _last_stage(results):
    return [r for r in results if r is not None][0]


SMALL = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)


@pytest.fixture(scope="module")
def interleaved_checkpoint(tmp_path_factory):
    """Tied-embedding model saved at TP 1 x PP 2 x VPP 2 (4 chunks over 2 ranks)."""
    tmp = tmp_path_factory.mktemp("interleaved")
    hf_dir = save_tiny_hf_folder("smollm2", str(tmp / "hf"), **SMALL)
    ckpt = str(tmp / "ckpt")
    run_ranks(_save, world_size=2, hf_dir=hf_dir, ckpt=ckpt, tp=1, pp=2, vpp=2)
    return hf_dir, ckpt


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 1)], ids=["tp2pp2", "tp1pp1"])
def test_load_at_another_layout(interleaved_checkpoint, tp, pp):
    """Loaded at another layout, logits equal transformers' (tied embeddings: the last stage's
    output copy is restored too)."""
    hf_dir, ckpt = interleaved_checkpoint
    assert os.path.isfile(os.path.join(ckpt, "model_config.json"))
    assert not os.path.exists(ckpt + ".tmp")
    model = build_tiny_hf_model("smollm2", **SMALL)
    input_ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids).logits
    got = _last_stage(
        run_ranks(
            _load_forward,
            world_size=tp * pp,
            hf_dir=hf_dir,
            ckpt=ckpt,
            tp=tp,
            pp=pp,
            input_ids=input_ids,
        )
    )
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.slow
def test_save_replaces_existing_checkpoint(tmp_path):
    hf_dir = save_tiny_hf_folder("llama", str(tmp_path / "hf"))
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    open(os.path.join(ckpt, "stale_file"), "w").close()
    run_ranks(_save, world_size=2, hf_dir=hf_dir, ckpt=ckpt, tp=2, pp=1)
    assert not os.path.exists(os.path.join(ckpt, "stale_file"))
    assert os.path.isfile(os.path.join(ckpt, "metadata.json"))
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("ckpt")) == ["ckpt"]


def test_load_from_non_checkpoint_folder(tmp_path):
    from dpo_megatron.checkpointing import load_model_checkpoint

    with pytest.raises(FileNotFoundError, match="not a megatron-core distributed checkpoint"):
        load_model_checkpoint([], str(tmp_path))


def _run_script(name, argv):
    from tests.scripts import load_script

    load_script(name).main(argv)


def _exported_exactly(hf_dir: str, out: str) -> dict:
    """The HF folder's tensors, after checking that the export ``out`` holds each bit for bit."""
    from safetensors.torch import load_file

    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(out, "model-00001-of-00001.safetensors"))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    return original


@pytest.mark.slow
def test_scripts_hf_to_megatron_to_hf_bit_exact(tmp_path):
    """convert_hf_to_megatron at TP 2, convert_megatron_to_hf at PP 2: every tensor comes back
    bit for bit (fp32), tokenizer files are copied, bf16 export halves the bytes."""
    from safetensors.torch import load_file

    hf_dir = save_tiny_hf_folder("qwen2", str(tmp_path / "hf"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(hf_dir, name), "w") as f:
            f.write("{}")
    ckpt, out, out16 = (str(tmp_path / n) for n in ("ckpt", "out", "out16"))
    run_ranks(
        _run_script,
        world_size=2,
        name="convert_hf_to_megatron",
        argv=["--hf-path", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "2"],
    )
    run_ranks(
        _run_script,
        world_size=2,
        name="convert_megatron_to_hf",
        argv=[
            "--load",
            ckpt,
            "--save",
            out,
            "--dtype",
            "float32",
            "--pipeline-model-parallel-size",
            "2",
        ],
    )
    original = _exported_exactly(hf_dir, out)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    run_ranks(
        _run_script,
        world_size=1,
        name="convert_megatron_to_hf",
        argv=["--load", ckpt, "--save", out16],
    )
    exported16 = load_file(os.path.join(out16, "model-00001-of-00001.safetensors"))
    assert all(exported16[k].dtype == torch.bfloat16 for k in exported16)
    assert all(torch.equal(exported16[k], original[k].to(torch.bfloat16)) for k in original)


@pytest.mark.slow
def test_export_of_a_mixture_of_experts_model_at_tp2_is_bit_exact(tmp_path):
    """convert_megatron_to_hf at TP 2 exports a mixture-of-experts checkpoint (its MoE layer
    needs sequence parallelism at TP > 1, which the exporter turns on as the importer does):
    every tensor comes back bit for bit (fp32)."""
    hf_dir = save_tiny_hf_folder("qwen3_moe", str(tmp_path / "hf"))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    run_ranks(
        _run_script,
        world_size=1,
        name="convert_hf_to_megatron",
        argv=["--hf-path", hf_dir, "--save", ckpt],
    )
    argv = ["--load", ckpt, "--save", out, "--dtype", "float32"]
    argv += ["--tensor-model-parallel-size", "2"]
    run_ranks(_run_script, world_size=2, name="convert_megatron_to_hf", argv=argv)
    _exported_exactly(hf_dir, out)
