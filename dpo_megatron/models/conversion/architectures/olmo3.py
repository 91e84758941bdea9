"""OLMo 3: the Llama projections, norms after attention and MLP (none before), query / key
RMSNorm over the whole projection, sliding windows in three of every four layers."""

from __future__ import annotations

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    COLUMN,
    TensorMap,
    decoder_dims,
    hf_layer_types,
    llama_rope,
    per_layer_type_rope,
    post_norm_tensors,
    sliding_window_fields,
)
from dpo_megatron.models.conversion.architectures.llama import llama_config_to_hf, llama_tensors


def olmo3_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
    pre_norms = (d + "input_layernorm.weight", d + "pre_mlp_layernorm.weight")
    qk_norms = (d + "self_attention.q_layernorm.weight", d + "self_attention.k_layernorm.weight")
    table = [t for t in llama_tensors(cfg) if t.megatron not in pre_norms + qk_norms]
    return (
        table
        + post_norm_tensors()
        + [
            # One weight over all heads, split with the heads (models.norms.ProjectionRMSNorm).
            TensorMap(qk_norms[0], (p + "self_attn.q_norm.weight",), COLUMN, (("q",),)),
            TensorMap(qk_norms[1], (p + "self_attn.k_norm.weight",), COLUMN, (("kv",),)),
        ]
    )


def olmo3_config_from_hf(hf) -> dict:
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"olmo3: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_bias", False):
        raise ValueError("olmo3: attention_bias=true is not supported")

    class _Flat:  # the one RoPE, read by the Llama-family RoPE rules
        rope_parameters = per_layer_type_rope(hf, "olmo3")

    theta, scaling_factor, linear_factor = llama_rope(_Flat, "olmo3")
    sliding = sliding_window_fields(hf)
    return dict(
        **decoder_dims(hf),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling_factor=scaling_factor,
        rope_linear_scaling_factor=linear_factor,
        no_rope_layers=None,
        sliding_window=sliding.get("sliding_window"),
        sliding_window_layers=sliding.get("sliding_window_layers"),
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        qk_norm_scope="projection",
        norm_placement="post",
        norm_weight_offset=False,
        embedding_scale=None,
        softmax_scale=None,
        local_rotary_base=None,
        parallel_residual=False,
        num_experts=None,
        moe_ffn_hidden_size=None,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def olmo3_config_to_hf(cfg: ModelConfig) -> dict:
    out = llama_config_to_hf(cfg)
    rope = out.pop("rope_parameters")
    out.pop("head_dim")
    out["rope_parameters"] = {"full_attention": rope, "sliding_attention": dict(rope)}
    out["sliding_window"] = cfg.sliding_window
    out["layer_types"] = hf_layer_types(cfg) or ["full_attention"] * cfg.num_layers
    out.pop("use_sliding_window", None)
    return out
