"""Gemma 3 (text): sandwich norms with (1 + w) RMSNorm, per-head q/k norms, GeGLU, scaled
embeddings, sliding windows in five of every six layers with their own RoPE theta."""

from __future__ import annotations

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    TensorMap,
    decoder_dims,
    dims,
    hf_layer_types,
    llama_rope,
    post_norm_tensors,
    sliding_window_fields,
)
from dpo_megatron.models.conversion.architectures.llama import llama_config_to_hf, llama_tensors


def gemma3_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
    renamed = {
        d + "pre_mlp_layernorm.weight": p + "pre_feedforward_layernorm.weight",
    }
    table = [
        TensorMap(t.megatron, (renamed[t.megatron],), t.split, t.shapes)
        if t.megatron in renamed
        else t
        for t in llama_tensors(cfg)
    ]
    return table + post_norm_tensors()


def gemma3_config_from_hf(hf) -> dict:
    name = hf.model_type
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ValueError(f"{name}: hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    for field_name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf, field_name, None):
            raise ValueError(f"{name}: {field_name}={getattr(hf, field_name)} is not supported")
    if getattr(hf, "use_bidirectional_attention", False) or getattr(hf, "attention_bias", False):
        raise ValueError(
            f"{name}: use_bidirectional_attention / attention_bias = true is not supported"
        )
    params = getattr(hf, "rope_parameters", None) or {}

    class _Full:  # the full-attention layers' RoPE, read by the Llama-family RoPE rules
        rope_parameters = params.get("full_attention", params)

    theta, scaling_factor, linear_factor = llama_rope(_Full, name)
    local = params.get("sliding_attention") or {}
    if local and local.get("rope_type", "default") != "default":
        raise ValueError(
            f"{name}: rope_parameters.sliding_attention.rope_type="
            f"{local['rope_type']!r} is not supported (default)"
        )
    sliding = sliding_window_fields(hf)
    local_theta = float(local.get("rope_theta", theta))
    differs = local_theta != theta or scaling_factor or linear_factor
    return dict(
        **decoder_dims(hf),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling_factor=scaling_factor,
        rope_linear_scaling_factor=linear_factor,
        local_rotary_base=local_theta if sliding and differs else None,
        no_rope_layers=None,
        sliding_window=sliding.get("sliding_window"),
        sliding_window_layers=sliding.get("sliding_window_layers"),
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        norm_weight_offset=True,
        embedding_scale=float(hf.hidden_size) ** 0.5,
        softmax_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        activation="geglu",
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        qk_norm_scope="head",
        norm_placement="sandwich",
        parallel_residual=False,
        num_experts=None,
        moe_ffn_hidden_size=None,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def gemma3_config_to_hf(cfg: ModelConfig) -> dict:
    out = llama_config_to_hf(cfg)
    full = out.pop("rope_parameters")
    local = {"rope_type": "default", "rope_theta": cfg.local_rotary_base or cfg.rotary_base}
    out.pop("hidden_act")
    out.update(
        rope_parameters={"full_attention": full, "sliding_attention": local},
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=round((cfg.softmax_scale or dims(cfg)["head_dim"] ** -0.5) ** -2),
        sliding_window=cfg.sliding_window,
        layer_types=hf_layer_types(cfg) or ["full_attention"] * cfg.num_layers,
    )
    out.pop("use_sliding_window", None)
    return out
