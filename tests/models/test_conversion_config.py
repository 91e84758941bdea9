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
        "learned_absolute",
        "LayerNorm",
        "gelu",
    )
    assert cfg.add_bias_linear and cfg.tie_word_embeddings and cfg.max_position_embeddings == 64


def test_base_supplies_non_architecture_fields(tmp_path):
    base = ModelConfig(
        params_dtype="bfloat16",
        transformer_impl="local",
        num_layers=99,
        recompute_granularity="full",
        pad_attention_heads=True,
        make_vocab_size_divisible_by=64,
    )
    cfg = model_config_from_hf(_tiny_config_folder(tmp_path, "llama"), base)
    assert cfg.num_layers == 4  # architecture: from config.json
    assert (cfg.params_dtype, cfg.transformer_impl, cfg.recompute_granularity) == (
        "bfloat16",
        "local",
        "full",
    )
    assert cfg.pad_attention_heads and cfg.make_vocab_size_divisible_by == 64


def test_transformers4_style_rope_keys(tmp_path):
    folder = _write_config(
        tmp_path,
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
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
        tmp_path,
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
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


# ---------------------------------------------------------------------------------------------
# Qwen3, Qwen3-MoE, Mixtral, GPT-NeoX
# ---------------------------------------------------------------------------------------------


def _new_config_folder(tmp_path, arch, **overrides):
    from transformers import AutoConfig

    from tests.models.conversion_helpers import NEW_TINY_CONFIGS

    kwargs = {**NEW_TINY_CONFIGS[arch], **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_qwen3_fields(tmp_path):
    cfg = model_config_from_hf(_new_config_folder(tmp_path, "qwen3"))
    assert cfg.qk_layernorm and cfg.tie_word_embeddings and not cfg.add_qkv_bias
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 32)
    assert cfg.kv_channels != cfg.hidden_size // cfg.num_attention_heads  # explicit head_dim
    assert cfg.rotary_base == 1e6 and cfg.norm_epsilon == 1e-6 and cfg.num_experts is None


def test_qwen3_moe_fields(tmp_path):
    cfg = model_config_from_hf(_new_config_folder(tmp_path, "qwen3_moe"))
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_norm_topk_prob and cfg.qk_layernorm and not cfg.tie_word_embeddings
    assert cfg.moe_aux_loss_coeff == 0.01  # router_aux_loss_coef
    off = model_config_from_hf(_new_config_folder(tmp_path, "qwen3_moe", norm_topk_prob=False))
    assert not off.moe_norm_topk_prob


def test_mixtral_fields(tmp_path):
    cfg = model_config_from_hf(_new_config_folder(tmp_path, "mixtral"))
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 48)
    assert cfg.moe_norm_topk_prob and not cfg.qk_layernorm and cfg.moe_aux_loss_coeff == 0.02


def test_moe_aux_loss_coeff_set_by_the_user_wins_over_config_json(tmp_path):
    folder = _new_config_folder(tmp_path, "qwen3_moe")
    assert model_config_from_hf(folder, ModelConfig(moe_aux_loss_coeff=0.0)).moe_aux_loss_coeff == 0
    assert (
        model_config_from_hf(folder, ModelConfig(moe_aux_loss_coeff=0.3)).moe_aux_loss_coeff == 0.3
    )


def test_gpt_neox_fields(tmp_path):
    cfg = model_config_from_hf(_new_config_folder(tmp_path, "gpt_neox"))
    assert cfg.parallel_residual and cfg.rotary_percent == 0.25
    assert (cfg.normalization, cfg.activation) == ("LayerNorm", "gelu_exact")
    assert cfg.add_bias_linear and not cfg.tie_word_embeddings
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 4, 16)


PYTHIA_28B_CONFIG = {  # EleutherAI/pythia-2.8b config.json as on the hub (transformers 4 keys)
    "architectures": ["GPTNeoXForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "gelu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 10240,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.24.0",
    "use_cache": True,
    "use_parallel_residual": True,
    "vocab_size": 50304,
}


def test_pythia_config_json_as_on_the_hub(tmp_path):
    cfg = model_config_from_hf(_write_config(tmp_path, **PYTHIA_28B_CONFIG))
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size) == (
        32,
        2560,
        10240,
        50304,
    )
    assert cfg.rotary_percent == 0.25 and cfg.rotary_base == 10000.0
    assert cfg.kv_channels == 80 and cfg.parallel_residual and cfg.activation == "gelu_exact"


@pytest.mark.parametrize(
    "arch, overrides, match",
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, "every layer must be an MoE layer"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "every layer must be an MoE layer"),
        ("mixtral", {"router_jitter_noise": 0.1}, "deterministic routing"),
        ("gpt_neox", {"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
        ("gpt_neox", {"attention_bias": False}, "attention_bias=false"),
    ],
)
def test_unrepresentable_new_architecture_settings_are_named(tmp_path, arch, overrides, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(_new_config_folder(tmp_path, arch, **overrides))


def test_unknown_architecture_lists_the_new_ones(tmp_path):
    folder = _write_config(tmp_path, model_type="falcon", hidden_size=64)
    with pytest.raises(ValueError) as err:
        model_config_from_hf(folder)
    for name in ("gpt_neox", "mixtral", "qwen3", "qwen3_moe", "llama"):
        assert repr(name) in str(err.value)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "gpt_neox", "llama32", "qwen25"])
def test_generated_config_of_new_architectures_derives_the_same_model(tmp_path, arch):
    """Export without a source folder: the written config.json derives the same ModelConfig, and
    names the right transformers class."""
    from dpo_megatron.models.conversion.hf_config import infer_architecture

    src = model_config_from_hf(_new_config_folder(tmp_path / "src", arch))
    standalone = ModelConfig(**{**src.__dict__, "hf_path": ""})
    written = hf_config_dict(standalone, "float32")
    out = _write_config(tmp_path / "out", **written)
    again = model_config_from_hf(out)
    assert {**again.__dict__, "hf_path": ""} == standalone.__dict__
    assert written["architectures"] == [infer_architecture(src).hf_class]
