"""GPT-2: learned positions, LayerNorm, GELU (tanh), biases everywhere, tied, Conv1D weights."""

from __future__ import annotations

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    COLUMN,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    TensorMap,
)


def gpt2_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "transformer.h.{i}."
    d = "decoder.layers.{i}."
    table = [
        TensorMap(
            "embedding.word_embeddings.weight",
            ("transformer.wte.weight",),
            VOCAB,
            (("vocab", "hidden"),),
        ),
        TensorMap(
            "embedding.position_embeddings.weight",
            ("transformer.wpe.weight",),
            REPLICATED,
            (("positions", "hidden"),),
        ),
        TensorMap(d + "input_layernorm.weight", (p + "ln_1.weight",), REPLICATED, (("hidden",),)),
        TensorMap(d + "input_layernorm.bias", (p + "ln_1.bias",), REPLICATED, (("hidden",),)),
        TensorMap(
            d + "self_attention.linear_qkv.weight",
            (p + "attn.c_attn.weight",),
            QKV,
            (("qkv", "hidden"),),
            transposed=True,
        ),
        TensorMap(
            d + "self_attention.linear_qkv.bias", (p + "attn.c_attn.bias",), QKV, (("qkv",),)
        ),
        TensorMap(
            d + "self_attention.linear_proj.weight",
            (p + "attn.c_proj.weight",),
            ROW,
            (("hidden", "q"),),
            transposed=True,
        ),
        TensorMap(
            d + "self_attention.linear_proj.bias",
            (p + "attn.c_proj.bias",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(d + "pre_mlp_layernorm.weight", (p + "ln_2.weight",), REPLICATED, (("hidden",),)),
        TensorMap(d + "pre_mlp_layernorm.bias", (p + "ln_2.bias",), REPLICATED, (("hidden",),)),
        TensorMap(
            d + "mlp.linear_fc1.weight",
            (p + "mlp.c_fc.weight",),
            COLUMN,
            (("ffn", "hidden"),),
            transposed=True,
        ),
        TensorMap(d + "mlp.linear_fc1.bias", (p + "mlp.c_fc.bias",), COLUMN, (("ffn",),)),
        TensorMap(
            d + "mlp.linear_fc2.weight",
            (p + "mlp.c_proj.weight",),
            ROW,
            (("hidden", "ffn"),),
            transposed=True,
        ),
        TensorMap(d + "mlp.linear_fc2.bias", (p + "mlp.c_proj.bias",), REPLICATED, (("hidden",),)),
        TensorMap(
            "decoder.final_layernorm.weight",
            ("transformer.ln_f.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            "decoder.final_layernorm.bias", ("transformer.ln_f.bias",), REPLICATED, (("hidden",),)
        ),
    ]
    if not cfg.tie_word_embeddings:
        table.append(
            TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB, (("vocab", "hidden"),))
        )
    return table


_PLAIN_LAYER = dict(
    norm_weight_offset=False,
    embedding_scale=None,
    softmax_scale=None,
    local_rotary_base=None,
    qk_norm_scope="head",
    norm_placement="pre",
    no_rope_layers=None,
    sliding_window=None,
    sliding_window_layers=None,
    rotary_percent=1.0,
    qk_layernorm=False,
    parallel_residual=False,
    num_experts=None,
    moe_ffn_hidden_size=None,
)
"""Architecture fields of a dense, sequential layer without query/key norms (GPT-2)."""


def gpt2_config_from_hf(hf) -> dict:
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"gpt2: activation_function={hf.activation_function!r} is not supported"
            " (gelu_new / gelu_pytorch_tanh)"
        )
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or not getattr(
        hf, "scale_attn_weights", True
    ):
        raise ValueError(
            "gpt2: scale_attn_by_inverse_layer_idx=true or scale_attn_weights=false"
            " is not supported"
        )
    return dict(
        num_layers=hf.n_layer,
        hidden_size=hf.n_embd,
        ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
        num_attention_heads=hf.n_head,
        num_query_groups=hf.n_head,
        kv_channels=hf.n_embd // hf.n_head,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.n_positions,
        position_embedding_type="learned_absolute",
        rope_scaling_factor=None,
        rope_linear_scaling_factor=None,
        normalization="LayerNorm",
        norm_epsilon=hf.layer_norm_epsilon,
        activation="gelu",
        add_bias_linear=True,
        add_qkv_bias=True,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        **_PLAIN_LAYER,
    )


def gpt2_config_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        n_layer=cfg.num_layers,
        n_embd=cfg.hidden_size,
        n_inner=cfg.ffn_hidden_size,
        n_head=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_position_embeddings,
        layer_norm_epsilon=cfg.norm_epsilon,
        activation_function="gelu_new",
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
