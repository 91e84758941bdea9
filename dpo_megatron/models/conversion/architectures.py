"""One table per Hugging Face architecture: HF tensor names <-> megatron-core names, and how each
tensor is split across tensor-parallel ranks; plus the HF config.json <-> ModelConfig translation.

Adding an architecture means adding an :class:`Architecture` to :data:`ARCHITECTURES` (a
config translator and a tensor table); the loader and exporter have no per-architecture code.

Names use ``{i}`` for the global 0-based layer index. megatron-core names are those of a
``GPTModel`` built with the local layer spec of :mod:`dpo_megatron.models.gpt` (norms are their
own modules: ``input_layernorm``, ``pre_mlp_layernorm``, ``final_layernorm``).

Logical shapes are written in megatron's orientation ``[out, in]`` with symbols resolved by
:func:`dims`: ``hidden``, ``ffn``, ``vocab`` (unpadded), ``positions``, ``q`` (heads x head_dim),
``kv`` (key/value heads x head_dim), ``qkv`` (q + 2 kv). ``transposed`` tensors are stored by HF
as ``[in, out]`` (GPT-2's ``Conv1D``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from dpo_megatron.models.config import ModelConfig

logger = logging.getLogger(__name__)

# How a tensor is split over the tensor-parallel group (megatron-core's layer types).
REPLICATED = "replicated"
"""Every TP rank holds the whole tensor (norms, row-parallel biases, position embeddings)."""
COLUMN = "column"
"""Split along dim 0, the output features (ColumnParallelLinear weight and bias)."""
ROW = "row"
"""Split along dim 1, the input features (RowParallelLinear weight)."""
VOCAB = "vocab"
"""Split along dim 0 over the vocabulary padded to a multiple of TP (padding rows are zero)."""
QKV = "qkv"
"""Fused query/key/value, per query group ``[q heads of the group..., k, v]``; TP rank r holds
groups ``[r*ng/tp, (r+1)*ng/tp)``. HF side: three tensors q, k, v, or one tensor [q; k; v]."""
GATE_UP = "gate_up"
"""Fused SwiGLU fc1: TP rank r holds ``[gate_r; up_r]`` (its slice of each). HF: gate, up."""
SPLITS = (REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP)


@dataclass(frozen=True)
class TensorMap:
    """One megatron-core parameter and the HF tensor(s) it is made of."""

    megatron: str
    """Parameter name in a ``GPTModel`` (``{i}``: global 0-based layer index)."""
    hf: tuple[str, ...]
    """HF tensor names, in the order the split expects (QKV: q, k, v or one fused; GATE_UP:
    gate, up)."""
    split: str
    """One of :data:`SPLITS`."""
    shapes: tuple[tuple[str, ...], ...]
    """Logical shape of each HF tensor in megatron orientation, as symbols (see module doc)."""
    transposed: bool = False
    """HF stores the 2-D tensors as ``[in, out]`` (GPT-2 ``Conv1D``)."""


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face architecture the converter knows."""

    name: str
    """Key in :data:`ARCHITECTURES`; equals HF's ``model_type``."""
    hf_class: str
    """The ``architectures`` entry written to an exported config.json."""
    config_from_hf: Callable[[Any], dict]
    """HF ``PretrainedConfig`` -> ModelConfig fields (architecture fields only)."""
    config_to_hf: Callable[[ModelConfig], dict]
    """ModelConfig -> HF config.json fields (used when exporting a model without a source
    config.json)."""
    tensors: Callable[[ModelConfig], list[TensorMap]]
    """The mapping table for a model of this config (entries depend on biases / tying)."""
    base_prefix: str = ""
    """Prefix of the base-model tensors in a ``*ForCausalLM`` checkpoint (HF's
    ``base_model_prefix`` + '.'); folders saved from the bare base model lack it."""
    ignored: tuple[str, ...] = field(default=())
    """HF tensor names (``{i}`` patterns) that may appear in a checkpoint and carry no weights
    (non-persistent buffers saved by old versions, e.g. rotary ``inv_freq``)."""


def dims(cfg: ModelConfig) -> dict[str, int]:
    """Values of the shape symbols used in tables, for this config."""
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return {
        "hidden": cfg.hidden_size,
        "ffn": cfg.ffn_hidden_size,
        "vocab": cfg.vocab_size,
        "positions": cfg.max_position_embeddings,
        "q": cfg.num_attention_heads * head_dim,
        "kv": groups * head_dim,
        "qkv": (cfg.num_attention_heads + 2 * groups) * head_dim,
    }


# ---------------------------------------------------------------------------------------------
# Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), SmolLM2 (tied embeddings).
# ---------------------------------------------------------------------------------------------

def _llama_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
    table = [
        TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB,
                  (("vocab", "hidden"),)),
        TensorMap(d + "input_layernorm.weight", (p + "input_layernorm.weight",), REPLICATED,
                  (("hidden",),)),
        TensorMap(d + "self_attention.linear_qkv.weight",
                  (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                   p + "self_attn.v_proj.weight"), QKV,
                  (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden"))),
        TensorMap(d + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), ROW,
                  (("hidden", "q"),)),
        TensorMap(d + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",),
                  REPLICATED, (("hidden",),)),
        TensorMap(d + "mlp.linear_fc1.weight",
                  (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), GATE_UP,
                  (("ffn", "hidden"), ("ffn", "hidden"))),
        TensorMap(d + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), ROW,
                  (("hidden", "ffn"),)),
        TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED,
                  (("hidden",),)),
    ]
    if cfg.add_qkv_bias:
        table.append(TensorMap(
            d + "self_attention.linear_qkv.bias",
            (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"),
            QKV, (("q",), ("kv",), ("kv",))))
    if not cfg.tie_word_embeddings:
        table.append(TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB,
                               (("vocab", "hidden"),)))
    return table


def _rope_parameters(hf) -> dict:
    """RoPE settings from a transformers 5 (``rope_parameters``) or 4 (``rope_theta`` +
    ``rope_scaling``) config, as one dict with ``rope_theta`` and ``rope_type``."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


# megatron-core's Llama-3 frequency scaling has these constants built in
# (RotaryEmbedding._apply_scaling); other values cannot be represented.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def _llama_config_from_hf(hf) -> dict:
    name = hf.model_type
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError(f"{name}: attention_bias / mlp_bias = true is not supported")
    rope = _rope_parameters(hf)
    rope_type = rope["rope_type"]
    scaling_factor = linear_factor = None
    if rope_type == "llama3":
        for key, value in _LLAMA3_FIXED.items():
            if float(rope.get(key, value)) != value:
                raise ValueError(
                    f"{name}: rope scaling {key}={rope[key]} is not supported; megatron-core's "
                    f"Llama-3 RoPE scaling fixes it to {value}")
        scaling_factor = float(rope["factor"])
    elif rope_type == "linear":  # Llama-2 style position interpolation
        linear_factor = float(rope["factor"])
    elif rope_type != "default":
        raise ValueError(f"{name}: rope_type={rope_type!r} is not supported "
                         "(supported: default, linear, llama3)")
    window = getattr(hf, "sliding_window", None)
    if window is not None and (name != "qwen2" or getattr(hf, "use_sliding_window", False)):
        logger.warning("%s: sliding_window=%s is ignored (full causal attention); outputs differ "
                       "from transformers only for sequences longer than the window", name, window)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        rope_scaling_factor=scaling_factor,
        rope_linear_scaling_factor=linear_factor,
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=name == "qwen2",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def _llama_config_to_hf(cfg: ModelConfig) -> dict:
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rotary_base,
                "factor": cfg.rope_scaling_factor, **_LLAMA3_FIXED}
    elif cfg.rope_linear_scaling_factor is not None:
        rope = {"rope_type": "linear", "rope_theta": cfg.rotary_base,
                "factor": cfg.rope_linear_scaling_factor}
    return dict(
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=dims(cfg)["q"] // cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope,
        rms_norm_eps=cfg.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


# ---------------------------------------------------------------------------------------------
# GPT-2: learned positions, LayerNorm, GELU (tanh), biases everywhere, tied, Conv1D weights.
# ---------------------------------------------------------------------------------------------

def _gpt2_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "transformer.h.{i}."
    d = "decoder.layers.{i}."
    table = [
        TensorMap("embedding.word_embeddings.weight", ("transformer.wte.weight",), VOCAB,
                  (("vocab", "hidden"),)),
        TensorMap("embedding.position_embeddings.weight", ("transformer.wpe.weight",),
                  REPLICATED, (("positions", "hidden"),)),
        TensorMap(d + "input_layernorm.weight", (p + "ln_1.weight",), REPLICATED, (("hidden",),)),
        TensorMap(d + "input_layernorm.bias", (p + "ln_1.bias",), REPLICATED, (("hidden",),)),
        TensorMap(d + "self_attention.linear_qkv.weight", (p + "attn.c_attn.weight",), QKV,
                  (("qkv", "hidden"),), transposed=True),
        TensorMap(d + "self_attention.linear_qkv.bias", (p + "attn.c_attn.bias",), QKV,
                  (("qkv",),)),
        TensorMap(d + "self_attention.linear_proj.weight", (p + "attn.c_proj.weight",), ROW,
                  (("hidden", "q"),), transposed=True),
        TensorMap(d + "self_attention.linear_proj.bias", (p + "attn.c_proj.bias",), REPLICATED,
                  (("hidden",),)),
        TensorMap(d + "pre_mlp_layernorm.weight", (p + "ln_2.weight",), REPLICATED,
                  (("hidden",),)),
        TensorMap(d + "pre_mlp_layernorm.bias", (p + "ln_2.bias",), REPLICATED, (("hidden",),)),
        TensorMap(d + "mlp.linear_fc1.weight", (p + "mlp.c_fc.weight",), COLUMN,
                  (("ffn", "hidden"),), transposed=True),
        TensorMap(d + "mlp.linear_fc1.bias", (p + "mlp.c_fc.bias",), COLUMN, (("ffn",),)),
        TensorMap(d + "mlp.linear_fc2.weight", (p + "mlp.c_proj.weight",), ROW,
                  (("hidden", "ffn"),), transposed=True),
        TensorMap(d + "mlp.linear_fc2.bias", (p + "mlp.c_proj.bias",), REPLICATED,
                  (("hidden",),)),
        TensorMap("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), REPLICATED,
                  (("hidden",),)),
        TensorMap("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), REPLICATED,
                  (("hidden",),)),
    ]
    if not cfg.tie_word_embeddings:
        table.append(TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB,
                               (("vocab", "hidden"),)))
    return table


def _gpt2_config_from_hf(hf) -> dict:
    if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"gpt2: activation_function={hf.activation_function!r} is not supported"
                         " (gelu_new / gelu_pytorch_tanh)")
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or not getattr(
            hf, "scale_attn_weights", True):
        raise ValueError("gpt2: scale_attn_by_inverse_layer_idx=true or scale_attn_weights=false"
                         " is not supported")
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
    )


def _gpt2_config_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_inner=cfg.ffn_hidden_size,
        n_head=cfg.num_attention_heads, vocab_size=cfg.vocab_size,
        n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_epsilon,
        activation_function="gelu_new", tie_word_embeddings=cfg.tie_word_embeddings,
    )


_LLAMA_IGNORED = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", _llama_config_from_hf,
                          _llama_config_to_hf, _llama_tensors, "model.", _LLAMA_IGNORED),
    "mistral": Architecture("mistral", "MistralForCausalLM", _llama_config_from_hf,
                            _llama_config_to_hf, _llama_tensors, "model.", _LLAMA_IGNORED),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", _llama_config_from_hf,
                          _llama_config_to_hf, _llama_tensors, "model.", _LLAMA_IGNORED),
    "gpt2": Architecture("gpt2", "GPT2LMHeadModel", _gpt2_config_from_hf, _gpt2_config_to_hf,
                         _gpt2_tensors, "transformer.",
                         ("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias")),
}


def get_architecture(model_type: str, source: str = "config.json") -> Architecture:
    """The table for HF ``model_type``.

    Raises:
        ValueError: naming the unknown type, where it came from, and the supported ones.
    """
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{source}: unknown architecture model_type={model_type!r}; supported: "
                         f"{sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def expand(pattern: str, layer: int | None) -> str:
    """A table name with ``{i}`` replaced by the layer index (names without ``{i}`` unchanged)."""
    return pattern.replace("{i}", str(layer)) if layer is not None else pattern


def is_layer_pattern(pattern: str) -> bool:
    """Whether a table name is per-layer (contains ``{i}``)."""
    return "{i}" in pattern
