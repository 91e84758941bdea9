"""Bad inputs: a clear error naming the culprit, and nothing written."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpo_megatron.models.conversion import check_hf_weights, load_hf_weights, model_config_from_hf
from tests.checkpointing.faults import Payload
from tests.models.conversion_helpers import save_tiny_hf_folder
from tests.multirank import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _edit_weights(folder, edit):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load(folder):
    """Import into no chunks: the whole-folder checks run before any parameter is touched."""
    load_hf_weights([], model_config_from_hf(folder), folder)


@pytest.fixture
def llama_dir(tmp_path):
    return save_tiny_hf_folder("llama", str(tmp_path / "hf"))


def test_missing_shard_is_named(tmp_path):
    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"), max_shard_size="40KB")
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(FileNotFoundError, match=f"weight shard {shard}"):
        _load(folder)


def test_missing_tensor_is_named(llama_dir):
    _edit_weights(llama_dir, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(KeyError, match="model.layers.2.mlp.up_proj.weight"):
        _load(llama_dir)


def test_shape_mismatch_is_named(llama_dir):
    def shrink(t):
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _edit_weights(llama_dir, shrink)
    with pytest.raises(
        ValueError,
        match=r"model.layers.1.self_attn.k_proj.weight.*\[16, 64\].*"
        r"\[32, 64\]",
    ):
        _load(llama_dir)


def test_unmapped_tensor_is_named(llama_dir):
    _edit_weights(llama_dir, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="not mapped.*model.layers.0.extra.weight"):
        _load(llama_dir)


def test_bad_weight_files_are_named_before_any_rank_reads_them(tmp_path):
    """``check_hf_weights`` (the launchers' pre-check) on what a copy or a download can leave
    behind: a shard cut short (its size against its header's), an index that is not JSON, an
    index naming a tensor its shard lacks, a tensor of another shape; a good sharded folder and
    a good ``.bin`` pass. Each error names the file or tensor, as one ValueError / OSError."""
    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"), max_shard_size="40KB")
    check_hf_weights(model_config_from_hf(folder))
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = os.path.join(folder, sorted(set(index["weight_map"].values()))[1])
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=rf"^{shard}: not a complete safetensors file: {len(data) // 2} bytes, its header "
        rf"describes {len(data)} \(cut short",
    ):
        check_hf_weights(model_config_from_hf(folder))
    open(shard, "wb").write(data)
    tensor = next(iter(index["weight_map"]))
    json.dump(
        {"weight_map": {**index["weight_map"], "extra.weight": index["weight_map"][tensor]}},
        open(index_path, "w"),
    )
    with pytest.raises(ValueError, match="tensor 'extra.weight' listed in the index is not in"):
        check_hf_weights(model_config_from_hf(folder))
    open(index_path, "w").write("{not json")
    with pytest.raises(ValueError, match=rf"^{index_path}: not a weights index"):
        check_hf_weights(model_config_from_hf(folder))

    single = save_tiny_hf_folder("llama", str(tmp_path / "single"))
    _edit_weights(single, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[3\], config.json"):
        check_hf_weights(model_config_from_hf(single))


def test_a_pickled_bin_is_refused_unread(tmp_path):
    """A ``pytorch_model.bin`` is a pickle: one that calls anything beyond tensors is refused,
    naming the file and the call, before it is loaded (the payload never runs); a plain one
    of tensors passes the same check."""
    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"), safe_serialization=False)
    check_hf_weights(model_config_from_hf(folder))
    path = os.path.join(folder, "pytorch_model.bin")
    marker = str(tmp_path / "PAYLOAD_RAN")
    torch.save({**torch.load(path, weights_only=True), "x": Payload(marker)}, path)
    with pytest.raises(ValueError, match=rf"^{path}: refused: its pickle calls posix.mkdir"):
        check_hf_weights(model_config_from_hf(folder))
    with pytest.raises(ValueError, match=rf"^{path}: refused"):
        _load(folder)  # the ranks' reader refuses it alike
    assert not os.path.exists(marker)


def test_unknown_architecture(llama_dir):
    path = os.path.join(llama_dir, "config.json")
    config = json.load(open(path))
    config["model_type"] = "falcon"
    json.dump(config, open(path, "w"))
    with pytest.raises(ValueError, match="unknown architecture model_type='falcon'"):
        _load(llama_dir)


@pytest.mark.parametrize(
    ("arch", "method", "recipe"),
    [
        ("llama", "fp8", "FineGrainedFP8Config(dequantize=True)"),
        ("deepseek_v3", "fp8", "FineGrainedFP8Config(dequantize=True)"),
        ("gpt_oss", "mxfp4", "Mxfp4Config(dequantize=True)"),
        ("qwen3", "awq", "<its quantization config>(dequantize=True)"),
    ],
)
def test_a_quantized_folder_is_refused_with_the_dequantize_recipe(tmp_path, arch, method, recipe):
    """Any architecture: the file, the method, transformers' dequantizing load, and where the
    copy goes (models.quantized, checked in model_config_from_hf)."""
    from transformers import AutoConfig

    from tests.models.conversion_helpers import NEW_TINY_CONFIGS, TINY_CONFIGS

    kwargs = dict({**TINY_CONFIGS, **NEW_TINY_CONFIGS}[arch])
    AutoConfig.for_model(kwargs.pop("model_type"), **kwargs).save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "config.json")
    config = json.load(open(path))
    config["quantization_config"] = {"quant_method": method}
    json.dump(config, open(path, "w"))
    with pytest.raises(ValueError) as raised:
        model_config_from_hf(str(tmp_path))
    message = str(raised.value)
    assert message.startswith(f"{tmp_path}/config.json: quantization_config ({method}) ")
    assert f"from_pretrained('{tmp_path}', quantization_config={recipe})" in message
    assert message.endswith("then save_pretrained to NEW_FOLDER) and set model.hf_path=NEW_FOLDER")


@pytest.mark.parametrize(
    "config_class", ["Qwen3NextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"]
)
def test_gated_deltanet_families_are_refused_with_the_reason(tmp_path, config_class):
    """Qwen3-Next / Qwen3.5 folders as transformers writes them: refused by name before any
    weight is read, with the reason (megatron-core's GatedDeltaNet runs only on Triton)."""
    import transformers

    config = getattr(transformers, config_class)(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"model_type='{config.model_type}' is not supported: "
        r"its gated DeltaNet layers .*Triton has no CPU driver",
    ):
        model_config_from_hf(str(tmp_path))


def _script(name):
    from tests.scripts import load_script

    return load_script(name)


def _convert(argv):
    _script("convert_hf_to_megatron").main(argv)


def _assert_nothing_written(save):
    assert not os.path.exists(save) and not os.path.exists(save + ".tmp")


def _stop_line(capsys, main, argv) -> str:
    """The one line a converter ends with at a mistake (``utils.exits.fail``: on stderr, exit
    status 2, as the engine's commands; under ``python -m dpo_megatron.launch`` one launcher
    line follows, no torchrun block)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_a_layout_the_model_or_the_ranks_cannot_take_ends_the_converter_in_one_line(
    llama_dir, tmp_path, capsys
):
    """The converter checks the model against its layout flags, then the layout against the
    ranks, before it starts megatron-core: a mistake ends it with one ``error:`` line (no
    traceback) and writes nothing."""
    save = str(tmp_path / "ckpt")
    argv = ["--hf-path", llama_dir, "--save", save]
    line = _stop_line(capsys, _convert, [*argv, "--expert-model-parallel-size", "2"])
    assert line == (
        "error: --expert-model-parallel-size 2 needs a mixture-of-experts model (model.num_experts)"
    )
    line = _stop_line(capsys, _convert, [*argv, "--pipeline-model-parallel-size", "2"])
    assert line.startswith("error: world size 1 is not divisible by ")
    _assert_nothing_written(save)


@pytest.mark.slow
def test_heads_not_divisible_by_tp_writes_nothing(tmp_path):
    folder = save_tiny_hf_folder("smollm2", str(tmp_path / "hf"))  # 9 heads, 3 KV heads
    save = str(tmp_path / "ckpt")
    match = r"divisible by --tensor-model-parallel-size 2 \(or set --pad-attention-heads to add"
    with pytest.raises(RuntimeError, match=match):
        run_ranks(
            _convert,
            world_size=2,
            argv=["--hf-path", folder, "--save", save, "--tensor-model-parallel-size", "2"],
        )
    _assert_nothing_written(save)


@pytest.mark.slow
def test_layers_not_divisible_by_pp_writes_nothing(tmp_path):
    folder = save_tiny_hf_folder("llama", str(tmp_path / "hf"), num_hidden_layers=3)
    save = str(tmp_path / "ckpt")
    with pytest.raises(
        RuntimeError, match="3 layers, not divisible by --pipeline-model-parallel-size 2"
    ):
        run_ranks(
            _convert,
            world_size=2,
            argv=["--hf-path", folder, "--save", save, "--pipeline-model-parallel-size", "2"],
        )
    _assert_nothing_written(save)


@pytest.mark.slow
def test_shape_mismatch_in_script_writes_nothing(llama_dir, tmp_path):
    _edit_weights(llama_dir, lambda t: t.update({"model.norm.weight": torch.zeros(65)}))
    save = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        run_ranks(_convert, world_size=1, argv=["--hf-path", llama_dir, "--save", save])
    _assert_nothing_written(save)


def _export_with_bad_config(hf_dir, out_dir):
    """Export at TP 2 x PP 2 a model whose config disagrees with its source config.json: rank 0
    fails before writing; every rank must raise (no hang) and nothing may be left behind."""
    import dataclasses

    from dpo_megatron.models import ModelConfig, build_model_chunks, export_hf, load_hf_weights
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    initialize_distributed(parallel)
    set_seed(0)
    cfg = model_config_from_hf(
        hf_dir, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, hf_dir)
    try:
        export_hf(chunks, dataclasses.replace(cfg, norm_epsilon=0.5), out_dir)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_failed_export_raises_on_every_rank_and_writes_nothing(llama_dir, tmp_path):
    out = str(tmp_path / "exported")
    errors = run_ranks(
        _export_with_bad_config, world_size=4, timeout=120, hf_dir=llama_dir, out_dir=out
    )
    assert all(e is not None and "norm_epsilon" in e for e in errors), errors
    assert os.listdir(tmp_path) == ["hf"]


# ---------------------------------------------------------------------------------------------
# Mixture of experts and GPT-NeoX: the same errors, per expert.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def moe_dir(tmp_path):
    return save_tiny_hf_folder("qwen3_moe", str(tmp_path / "moe"))


def test_missing_expert_tensor_is_named(moe_dir):
    _edit_weights(moe_dir, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        _load(moe_dir)


def test_expert_shape_mismatch_is_named(moe_dir):
    def shrink(t):
        t["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 16)

    _edit_weights(moe_dir, shrink)
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight.*\[64, 16\].*\[64, 32\]"):
        _load(moe_dir)


def test_expert_beyond_num_experts_is_unmapped(moe_dir):
    _edit_weights(
        moe_dir,
        lambda t: t.update({"model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(32, 64)}),
    )
    with pytest.raises(ValueError, match=r"not mapped.*experts\.4\.gate_proj"):
        _load(moe_dir)


def test_gpt_neox_missing_and_unmapped_tensors(tmp_path):
    folder = save_tiny_hf_folder("gpt_neox", str(tmp_path / "neox"))
    _edit_weights(
        folder,
        lambda t: t.update(
            {
                "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.zeros(
                    2
                ),  # old buffer: fine
                "gpt_neox.layers.1.attention.masked_bias": torch.zeros(()),
            }
        ),
    )
    _load(folder)
    _edit_weights(folder, lambda t: t.pop("embed_out.weight"))
    with pytest.raises(KeyError, match="embed_out.weight"):
        _load(folder)


@pytest.mark.parametrize(
    "parallel, match",
    [
        (
            dict(expert_model_parallel_size=3),
            "4 experts, not divisible by parallel.expert_model_parallel_size=3",
        ),
        (
            dict(expert_tensor_parallel_size=3),
            r"expert width 32 .* not divisible by "
            "parallel.expert_tensor_parallel_size=3",
        ),
        (dict(tensor_model_parallel_size=2), "needs parallel.sequence_parallel=true"),
        (dict(tensor_model_parallel_size=3), "divisible by parallel.tensor_model_parallel_size=3"),
    ],
)
def test_moe_layout_errors_name_the_fields(moe_dir, parallel, match):
    from dpo_megatron.models import build_transformer_config
    from dpo_megatron.parallel import ParallelConfig

    with pytest.raises(ValueError, match=match):
        build_transformer_config(model_config_from_hf(moe_dir), ParallelConfig(**parallel))


def test_expert_parallel_without_experts_and_world_size(llama_dir):
    from dpo_megatron.models import build_transformer_config
    from dpo_megatron.parallel import ParallelConfig

    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        build_transformer_config(
            model_config_from_hf(llama_dir), ParallelConfig(expert_model_parallel_size=2)
        )
    with pytest.raises(
        ValueError,
        match=r"world size 2 is not divisible by "
        r"parallel.expert_tensor_parallel_size \(2\) x "
        r"parallel.expert_model_parallel_size \(2\)",
    ):
        ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2).validate(2)
    ParallelConfig(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    ).validate(2)  # EP carved from the TP ranks


def test_the_converters_refuse_an_output_folder_they_would_replace(tmp_path, monkeypatch, capsys):
    """Each converter writes a whole folder and renames it into place: a ``--save`` folder that
    is not empty (another model's files) is refused in one line unless ``--overwrite``, and one
    that is or holds its source always; nothing is touched. A ``--load`` that is a run folder
    points at its ``checkpoints``; a missing local ``--hf-path`` is one line without the hub
    hint."""
    to_hf, to_megatron = _script("convert_megatron_to_hf"), _script("convert_hf_to_megatron")
    models = tmp_path / "models"
    (models / "other_model").mkdir(parents=True)
    (models / "other_model" / "weights.bin").write_text("keep me")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cases = [
        (
            to_hf,
            ["--load", str(run), "--save", str(models)],
            f"error: --save {models} is not empty",
        ),
        (to_megatron, ["--hf-path", "x", "--save", str(models)], f"error: --save {models} is not"),
        (to_hf, ["--load", str(run), "--save", str(run)], f"error: --save {run} is or holds {run}"),
        (to_hf, ["--load", str(run), "--save", str(tmp_path / "new")], f"{run} is a run folder"),
    ]
    for script, argv, message in cases:
        line = _stop_line(capsys, script.main, argv)
        assert message in line, line
    assert (models / "other_model" / "weights.bin").read_text() == "keep me"
    from dpo_megatron.utils.files import check_output_folder

    check_output_folder(models, [str(run)], overwrite=True)  # --overwrite: replaced as asked
    check_output_folder(run / "checkpoints" / "hf", [str(run / "checkpoints")])  # inside: fine
    monkeypatch.chdir(tmp_path)
    line = _stop_line(
        capsys, to_megatron.main, ["--hf-path", "models/nope", "--save", str(tmp_path / "ckpt")]
    )
    assert line.startswith("error: --hf-path models/nope/config.json: no config")
    assert "hub name" not in line
