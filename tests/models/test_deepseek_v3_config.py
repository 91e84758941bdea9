"""DeepSeek-V3's config.json -> ModelConfig -> megatron-core's MLA / MoE config, and every setting
that is not served refused by name at config time (no processes: seconds)."""

from __future__ import annotations

import dataclasses

import pytest

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion import model_config_from_hf
from dpo_megatron.models.conversion.hf_config import hf_config_dict, infer_architecture
from dpo_megatron.models.transformer_config import build_transformer_config
from dpo_megatron.parallel import ParallelConfig
from tests.models.test_conversion_config import _new_config_folder, _write_config

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
"""DeepSeek-V3's own RoPE settings (its config.json)."""


@pytest.fixture
def cfg(tmp_path):
    return model_config_from_hf(_new_config_folder(tmp_path, "deepseek_v3"))


def test_fields_of_the_tiny_config(cfg):
    assert (cfg.kv_lora_rank, cfg.q_lora_rank) == (32, 48)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (16, 8, 16)
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (8, 4, 32)
    assert cfg.moe_first_dense_layers == 1 and cfg.moe_shared_expert_ffn_hidden_size == 32
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_expert_bias
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)
    assert cfg.moe_routed_scaling_factor == 2.5 and cfg.moe_aux_loss_coeff == 0.0


def test_megatron_config_is_mla_with_deepseek_routing(cfg):
    config = build_transformer_config(
        dataclasses.replace(cfg, params_dtype="float32"), ParallelConfig()
    )
    assert config.multi_latent_attention and config.rope_type == "rope"
    assert (config.q_lora_rank, config.kv_lora_rank) == (48, 32)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 8, 16)
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert config.moe_router_score_function == "sigmoid"
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_shared_expert_intermediate_size == 32


def test_yarn_as_deepseek_v3_states_it(tmp_path):
    """DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1) reaches megatron-core's MLA
    config (its softmax scale is then m(40, 1) ** 2 / sqrt(24); the numbers are checked against
    transformers by the deepseek_v3_yarn parity case of test_new_architectures)."""
    cfg = model_config_from_hf(
        _new_config_folder(
            tmp_path, "deepseek_v3", rope_parameters=YARN, max_position_embeddings=163840
        )
    )
    assert cfg.rope_yarn_factor == 40.0 and cfg.rope_yarn_original_max_position_embeddings == 4096
    assert (cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (1.0, 1.0)
    config = build_transformer_config(
        dataclasses.replace(cfg, params_dtype="float32"), ParallelConfig()
    )
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 40.0
    assert (config.mscale, config.mscale_all_dim) == (1.0, 1.0)
    with pytest.raises(ValueError, match="drop model.rope_scaling_factor"):
        dataclasses.replace(cfg, rope_scaling_factor=8.0).validate()


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rope_interleave": False}, "rope_interleave=false is not supported"),
        (
            {"rope_parameters": {**YARN, "attention_factor": 1.2}},
            "attention_factor=1.2 is not supported with YaRN",
        ),
        (
            {"rope_parameters": {**YARN, "mscale": 0.7, "mscale_all_dim": 0.0}},
            "mscale=0.7 without mscale_all_dim",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type='dynamic' is not supported",
        ),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unserved_hf_settings_are_named(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(_new_config_folder(tmp_path, "deepseek_v3", **overrides))


@pytest.mark.parametrize(
    "model_overrides, parallel_overrides, match",
    [
        ({"moe_norm_topk_prob": False}, {}, "moe_norm_topk_prob=true"),
        ({"moe_router_group_topk": 1}, {}, "top 2"),
        ({"moe_aux_loss_coeff": 0.01}, {}, "moe_first_dense_layers=1"),
        ({"moe_first_dense_layers": 4}, {}, "must be below model.num_layers"),
        ({"local_attention": "megatron"}, {}, "local_attention=megatron"),
        ({"sliding_window": 4}, {}, "model.sliding_window"),
        ({}, {"context_parallel_size": 2}, "context_parallel_size"),
        (
            {
                "num_attention_heads": 6,
                "num_query_groups": 6,
                "pad_attention_heads": True,
                "pad_attention_heads_multiple": 4,
            },
            {"tensor_model_parallel_size": 4, "sequence_parallel": True},
            "not padded",
        ),
        (
            {"q_lora_rank": 47},
            {"tensor_model_parallel_size": 2, "sequence_parallel": True},
            "q_lora_rank=47",
        ),
    ],
)
def test_unserved_layouts_are_refused_at_config_time(
    cfg, model_overrides, parallel_overrides, match
):
    model = dataclasses.replace(cfg, params_dtype="float32", **model_overrides)
    parallel = ParallelConfig(**parallel_overrides)
    with pytest.raises(ValueError, match=match):
        build_transformer_config(model, parallel)


def test_generated_config_derives_the_same_model(tmp_path, cfg):
    """Export without a source folder: the written config.json is DeepSeek-V3's and derives the
    same ModelConfig."""
    standalone = ModelConfig(**{**cfg.__dict__, "hf_path": ""})
    written = hf_config_dict(standalone, "float32")
    assert written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert infer_architecture(standalone).name == "deepseek_v3"
    again = model_config_from_hf(_write_config(tmp_path / "out", **written))
    assert {**again.__dict__, "hf_path": ""} == standalone.__dict__


def test_a_base_configs_deepseek_fields_do_not_reach_another_architecture(tmp_path, cfg):
    other = model_config_from_hf(_new_config_folder(tmp_path / "qwen3", "qwen3"), cfg)
    assert other.kv_lora_rank is None and other.moe_first_dense_layers == 0
    assert other.moe_router_score_function == "softmax" and not other.moe_router_expert_bias
