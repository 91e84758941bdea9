"""config.json -> ModelConfig for each architecture, and the config written on export."""

import json
import os

import pytest

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion import model_config_from_hf
from dpo_megatron.models.conversion.hf_config import hf_config_dict
from tests.models.conversion_helpers import TINY_CONFIGS


def _write_config(folder, **fields):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(fields, f)
    return str(folder)


def _tiny_config_folder(tmp_path, arch):
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[arch])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_llama3_fields(tmp_path):
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "llama"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (128, 16384)
    assert cfg.rotary_base == 500000.0 and cfg.rope_scaling_factor == 8.0
    assert cfg.rope_linear_scaling_factor is None
    assert (cfg.normalization, cfg.norm_epsilon, cfg.activation) == ("RMSNorm", 1e-5, "swiglu")
    assert not cfg.tie_word_embeddings and not cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.position_embedding_type == "rope" and cfg.hf_path == str(tmp_path)


def test_llama2_linear_rope_scaling(tmp_path):
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "llama2"))
    assert cfg.rope_linear_scaling_factor == 4.0 and cfg.rope_scaling_factor is None
    assert cfg.num_query_groups == 4 and cfg.rotary_base == 10000.0


def test_mistral_head_dim_is_not_hidden_over_heads(tmp_path):
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "mistral"))
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (8, 2, 16)
    assert cfg.norm_epsilon == 1e-6 and cfg.rope_scaling_factor is None


def test_qwen2_has_qkv_bias_only(tmp_path):
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "qwen2"))
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.vocab_size == 160


def test_smollm2_tied(tmp_path):
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "smollm2"))
    assert cfg.tie_word_embeddings and cfg.rotary_base == 100000.0
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (9, 3, 8)


def test_gpt2_fields(tmp_path):
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "gpt2"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 256)
    assert (cfg.position_embedding_type, cfg.normalization, cfg.activation) == (
        "learned_absolute", "LayerNorm", "gelu")
    assert cfg.add_bias_linear and cfg.tie_word_embeddings and cfg.max_position_embeddings == 64


def test_base_supplies_non_architecture_fields(tmp_path):
    base = ModelConfig(params_dtype="bfloat16", transformer_impl="local", num_layers=99,
                       recompute_granularity="full", pad_attention_heads=True,
                       make_vocab_size_divisible_by=64)
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "llama"), base)
    assert cfg.num_layers == 4  # architecture: from config.json
    assert (cfg.params_dtype, cfg.transformer_impl, cfg.recompute_granularity) == (
        "bfloat16", "local", "full")
    assert cfg.pad_attention_heads and cfg.make_vocab_size_divisible_by == 64


def test_transformers4_style_rope_keys(tmp_path):
    folder = _write_config(
        tmp_path, model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=128, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = model_config_from_hf(folder)
    assert cfg.rotary_base == 500000.0 and cfg.rope_scaling_factor == 32.0


def test_unknown_architecture_is_named(tmp_path):
    folder = _write_config(tmp_path, model_type="bert", hidden_size=64)
    with pytest.raises(ValueError, match="unknown architecture model_type='bert'"):
        model_config_from_hf(folder)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_config_from_hf(str(tmp_path))


def test_unrepresentable_llama3_constants_rejected(tmp_path):
    folder = _write_config(
        tmp_path, model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=128, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="low_freq_factor"):
        model_config_from_hf(folder)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_generated_config_derives_the_same_model(tmp_path, arch):
    """An export without a source folder writes a config.json that derives the same
    ModelConfig (what AutoModel will build is what was trained)."""
    src = model_config_from_hf(_tiny_config_folder(tmp_path / "src", arch))
    standalone = ModelConfig(**{**src.__dict__, "hf_path": ""})
    out = _write_config(tmp_path / "out", **hf_config_dict(standalone, "float32"))
    again = model_config_from_hf(out)
    assert {**again.__dict__, "hf_path": ""} == standalone.__dict__
