"""Model presets: the reference DPO repo's names resolve to its hub models or a local copy."""

import json
import os

import pytest

from dpo_megatron.models.conversion import ARCHITECTURES, model_config_from_hf
from dpo_megatron.models.presets import MODELS_DIR_ENV, PRESETS, resolve_model_preset
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
    assert {p.model_type for p in PRESETS.values()} <= set(ARCHITECTURES)


def test_a_local_copy_wins_and_must_be_that_model(tmp_path, monkeypatch):
    folder = _local_copy(tmp_path, "EleutherAI/pythia-2.8b", PYTHIA_28B_CONFIG)
    assert resolve_model_preset("pythia28", [str(tmp_path)]) == folder
    monkeypatch.setenv(MODELS_DIR_ENV, os.pathsep.join(["/nonexistent", str(tmp_path)]))
    assert resolve_model_preset("pythia28") == folder
    assert resolve_model_preset("pythia69") == "EleutherAI/pythia-6.9b"  # no local copy
    # The table's facts are those of the real config.json.
    preset, cfg = PRESETS["pythia28"], model_config_from_hf(folder)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size,
            cfg.vocab_size) == (preset.num_layers, preset.hidden_size,
                                preset.num_attention_heads, preset.ffn_hidden_size,
                                preset.vocab_size)
    _local_copy(tmp_path / "other", "pythia-2.8b", {**PYTHIA_28B_CONFIG, "hidden_size": 2048})
    with pytest.raises(ValueError, match="hidden_size=2048.*'pythia28'.*another model"):
        resolve_model_preset("pythia28", [str(tmp_path / "other")])


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown model preset 'gptj'.*pythia28.*pythia69"):
        resolve_model_preset("gptj", [])
