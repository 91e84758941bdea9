"""GPT-NeoX (Pythia): parallel residual, partial rotary, LayerNorm and linear biases, untied."""

from __future__ import annotations

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    COLUMN,
    REPLICATED,
    ROW,
    VOCAB,
    TensorMap,
    rope_parameters,
)


def gpt_neox_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "gpt_neox.layers.{i}."
    d = "decoder.layers.{i}."
    table = [
        TensorMap(
            "embedding.word_embeddings.weight",
            ("gpt_neox.embed_in.weight",),
            VOCAB,
            (("vocab", "hidden"),),
        ),
        TensorMap(
            d + "input_layernorm.weight",
            (p + "input_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "input_layernorm.bias", (p + "input_layernorm.bias",), REPLICATED, (("hidden",),)
        ),
        # GPT-NeoX fuses q, k, v per head ([heads, 3 * head_dim] rows: q_h, k_h, v_h), which is
        # megatron-core's per-group layout with one query head per group: TP rank r's rows are
        # a contiguous block of heads, i.e. a plain column split.
        TensorMap(
            d + "self_attention.linear_qkv.weight",
            (p + "attention.query_key_value.weight",),
            COLUMN,
            (("qkv", "hidden"),),
        ),
        TensorMap(
            d + "self_attention.linear_qkv.bias",
            (p + "attention.query_key_value.bias",),
            COLUMN,
            (("qkv",),),
        ),
        TensorMap(
            d + "self_attention.linear_proj.weight",
            (p + "attention.dense.weight",),
            ROW,
            (("hidden", "q"),),
        ),
        TensorMap(
            d + "self_attention.linear_proj.bias",
            (p + "attention.dense.bias",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "pre_mlp_layernorm.weight",
            (p + "post_attention_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "pre_mlp_layernorm.bias",
            (p + "post_attention_layernorm.bias",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "mlp.linear_fc1.weight",
            (p + "mlp.dense_h_to_4h.weight",),
            COLUMN,
            (("ffn", "hidden"),),
        ),
        TensorMap(d + "mlp.linear_fc1.bias", (p + "mlp.dense_h_to_4h.bias",), COLUMN, (("ffn",),)),
        TensorMap(
            d + "mlp.linear_fc2.weight",
            (p + "mlp.dense_4h_to_h.weight",),
            ROW,
            (("hidden", "ffn"),),
        ),
        TensorMap(
            d + "mlp.linear_fc2.bias", (p + "mlp.dense_4h_to_h.bias",), REPLICATED, (("hidden",),)
        ),
        TensorMap(
            "decoder.final_layernorm.weight",
            ("gpt_neox.final_layer_norm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            "decoder.final_layernorm.bias",
            ("gpt_neox.final_layer_norm.bias",),
            REPLICATED,
            (("hidden",),),
        ),
    ]
    if not cfg.tie_word_embeddings:
        table.append(
            TensorMap("output_layer.weight", ("embed_out.weight",), VOCAB, (("vocab", "hidden"),))
        )
    return table


_NEOX_ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}


def gpt_neox_config_from_hf(hf) -> dict:
    if hf.hidden_act not in _NEOX_ACTIVATIONS:
        raise ValueError(
            f"gpt_neox: hidden_act={hf.hidden_act!r} is not supported "
            f"(supported: {sorted(_NEOX_ACTIVATIONS)})"
        )
    if not getattr(hf, "attention_bias", True):
        raise ValueError(
            "gpt_neox: attention_bias=false is not supported (megatron-core puts "
            "biases on all linear layers or none; the MLP has them)"
        )
    rope = rope_parameters(hf)
    if rope["rope_type"] != "default":
        raise ValueError(
            f"gpt_neox: rope_type={rope['rope_type']!r} is not supported (supported: default)"
        )
    partial = rope.get("partial_rotary_factor", getattr(hf, "rotary_pct", 1.0))
    heads = hf.num_attention_heads
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hf.hidden_size // heads,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta", getattr(hf, "rotary_emb_base", 10000.0))),
        rotary_percent=float(partial),
        rope_scaling_factor=None,
        rope_linear_scaling_factor=None,
        normalization="LayerNorm",
        norm_epsilon=hf.layer_norm_eps,
        activation=_NEOX_ACTIVATIONS[hf.hidden_act],
        add_bias_linear=True,
        add_qkv_bias=True,
        qk_layernorm=False,
        parallel_residual=bool(getattr(hf, "use_parallel_residual", True)),
        no_rope_layers=None,
        sliding_window=None,
        sliding_window_layers=None,
        qk_norm_scope="head",
        norm_placement="pre",
        norm_weight_offset=False,
        embedding_scale=None,
        softmax_scale=None,
        local_rotary_base=None,
        num_experts=None,
        moe_ffn_hidden_size=None,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def gpt_neox_config_to_hf(cfg: ModelConfig) -> dict:
    activation = {"gelu_exact": "gelu", "gelu": "gelu_new"}[cfg.activation]
    return dict(
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rotary_base,
            "partial_rotary_factor": cfg.rotary_percent,
        },
        layer_norm_eps=cfg.norm_epsilon,
        hidden_act=activation,
        attention_bias=True,
        use_parallel_residual=cfg.parallel_residual,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
