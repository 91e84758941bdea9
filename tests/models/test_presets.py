"""Model presets: the reference DPO repo's names resolve to its hub models or a local copy."""

import json
import os

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

    with pytest.raises(FileNotFoundError, match="hub name: download it.*DPO_MEGATRON_MODELS"):
        model_config_from_hf("EleutherAI/pythia-70m")


def test_smollm2_preset_facts_are_those_of_the_cached_folder():
    from dpo_megatron.utils.cache import cache_root

    folder = cache_root() / "smollm2-135m-instruct"
    if not (folder / "config.json").is_file():
        pytest.skip("SmolLM2 asset not cached")
    from dpo_megatron.models.presets import _check_folder

    _check_folder(str(folder), "smollm2", MODEL_PRESETS["smollm2"])  # raises on any difference
