"""What every architecture table is made of: the tensor-parallel split kinds, :class:`TensorMap`,
:class:`Architecture`, the shape symbols (:func:`dims`), the ``{i}`` / ``{e}`` name patterns, and
the HF config readers more than one family shares (RoPE, sliding windows).

Names use ``{i}`` for the global 0-based layer index and ``{e}`` for the global 0-based expert
index of a mixture-of-experts layer. megatron-core names are those of a ``GPTModel`` built with
the local layer spec of :mod:`dpo_megatron.models.gpt` (norms are their own modules:
``input_layernorm``, ``pre_mlp_layernorm``, ``final_layernorm``; an MoE layer's experts are
``mlp.experts.local_experts.<local index>``, mapped to ``{e}`` by the loader).

Logical shapes are written in megatron's orientation ``[out, in]`` with symbols resolved by
:func:`dims`: ``hidden``, ``ffn``, ``vocab`` (unpadded), ``positions``, ``q`` (heads x head_dim),
``kv`` (key/value heads x head_dim), ``qkv`` (q + 2 kv), ``head_dim``, ``experts``,
``expert_ffn`` (one expert's intermediate width), ``heads`` (query heads: gpt-oss's attention
sinks), ``labels`` (1: a reward head's outputs).
``transposed`` tensors are stored by HF as ``[in, out]`` (GPT-2's ``Conv1D``). Tensors of an
expert (``{e}`` in the name) are split over the expert tensor-parallel group instead of the
tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dpo_megatron.models.config import ModelConfig

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

# transformers 5 holds an MoE layer's routed experts (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss)
# as two stacked parameters of ``mlp.experts``, whatever the checkpoint's per-expert names.
HF_STACKED_GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"
"""[experts, 2 x expert_ffn, hidden]: each expert's [gate; up] (megatron's fc1 in HF order);
gpt-oss: [experts, hidden, 2 x expert_ffn], gate and up interleaved (``hf_interleaved``)."""
HF_STACKED_DOWN = "model.layers.{i}.mlp.experts.down_proj"
"""[experts, hidden, expert_ffn]: each expert's down projection (megatron's fc2); gpt-oss:
[experts, expert_ffn, hidden]."""


@dataclass(frozen=True)
class TensorMap:
    """One megatron-core parameter and the HF tensor(s) it is made of."""

    megatron: str
    """Parameter name in a ``GPTModel`` (``{i}``: global 0-based layer index, ``{e}``: global
    0-based expert index)."""
    hf: tuple[str, ...]
    """HF tensor names, in the order the split expects (QKV: q, k, v or one fused; GATE_UP:
    gate, up)."""
    split: str
    """One of :data:`SPLITS`."""
    shapes: tuple[tuple[str, ...], ...]
    """Logical shape of each HF tensor in megatron orientation, as symbols (see module doc)."""
    transposed: bool = False
    """HF stores the 2-D tensors as ``[in, out]`` (GPT-2 ``Conv1D``)."""
    layers: tuple[int, ...] | None = None
    """The global layers that hold this tensor (DeepSeek-V3: the dense MLP of its first layers,
    the experts of the others); None: every layer."""
    hf_stacked: str | None = None
    """An expert tensor's (``{e}``) place in transformers 5's model in memory: the 3-D parameter
    that stacks every expert of layer ``{i}`` (:data:`HF_STACKED_GATE_UP`,
    :data:`HF_STACKED_DOWN`), the name PEFT's ``target_parameters`` adapts. None: not stacked."""
    hf_interleaved: bool = False
    """The stacked parameter holds this entry's HF tensors (gate, up) interleaved along the
    output (gpt-oss's ``gate_up_proj``: gate row 0, up row 0, gate row 1, ...;
    :func:`interleave_rows`) instead of one after the other."""

    @property
    def expert(self) -> bool:
        """A tensor of one expert: split over the expert tensor-parallel group."""
        return is_expert_pattern(self.megatron)


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
    file_layout: Any | None = None
    """How the checkpoint stores tensors the table names one by one, when it does otherwise
    (gpt-oss: every expert of a layer in one stacked tensor, gate and up interleaved): an
    object with ``view(reader) -> reader`` (load: the stored tensors presented under the
    table's names) and ``pack(tensors, cfg) -> tensors`` (export: the table's tensors written
    as stored). None: the files hold the table's names."""

    def table(self, cfg: ModelConfig) -> list[TensorMap]:
        """The tensor table of a model of ``cfg`` with its head: :attr:`tensors` for a causal
        LM; for a reward model (``cfg.head == "reward"``) the same without the LM head, plus
        the reward head ``reward_head.weight`` <-> HF's ``score.weight`` [1, hidden],
        replicated over TP (``*ForSequenceClassification`` with ``num_labels=1``: every family
        names it ``score``, beside the base model)."""
        tensors = self.tensors(cfg)
        if cfg.head != "reward":
            return tensors
        return [t for t in tensors if t.megatron != "output_layer.weight"] + [
            TensorMap("reward_head.weight", ("score.weight",), REPLICATED, (("labels", "hidden"),))
        ]

    def hf_class_for(self, head: str) -> str:
        """The ``architectures`` entry of an exported folder: :attr:`hf_class` for a causal LM,
        for a reward model the class transformers' ``AutoModelForSequenceClassification`` builds
        for this ``model_type`` (``LlamaForSequenceClassification``,
        ``Gemma3TextForSequenceClassification``, ...).

        Raises:
            ValueError: transformers has no sequence-classification class for it.
        """
        if head != "reward":
            return self.hf_class
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES,
        )

        if self.name not in CLASSES:
            raise ValueError(f"transformers has no sequence-classification class for {self.name}")
        return CLASSES[self.name]


def dims(cfg: ModelConfig) -> dict[str, int]:
    """Values of the shape symbols used in tables, for this config."""
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups or cfg.num_attention_heads
    heads = cfg.num_attention_heads
    mla = {}
    if cfg.kv_lora_rank is not None:  # multi-latent attention (DeepSeek-V3)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        mla = {
            "q_lora": cfg.q_lora_rank or 0,
            "kv_lora": cfg.kv_lora_rank,
            "mla_q": heads * qk,  # per head [nope; rope]
            "mla_kv_a": cfg.kv_lora_rank + cfg.qk_rope_head_dim,  # [latent; shared rope key]
            "mla_kv_b": heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),  # per head [k; v]
            "mla_o": heads * cfg.v_head_dim,
        }
    return {
        **mla,
        "shared_ffn": cfg.moe_shared_expert_ffn_hidden_size or 0,
        "hidden": cfg.hidden_size,
        "ffn": cfg.ffn_hidden_size,
        "expert_ffn": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        "experts": cfg.num_experts or 0,
        "head_dim": head_dim,
        "heads": heads,
        "vocab": cfg.vocab_size,
        "positions": cfg.max_position_embeddings,
        "q": cfg.num_attention_heads * head_dim,
        "kv": groups * head_dim,
        "qkv": (cfg.num_attention_heads + 2 * groups) * head_dim,
        "labels": 1,
    }


def expand(pattern: str, layer: int | None, expert: int | None = None) -> str:
    """A table name with ``{i}`` replaced by the layer index and ``{e}`` by the expert index
    (names without them unchanged)."""
    if layer is not None:
        pattern = pattern.replace("{i}", str(layer))
    if expert is not None:
        pattern = pattern.replace("{e}", str(expert))
    return pattern


def interleave_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``k`` tensors [n, ...] -> [k * n, ...] with row ``j * k + m`` = row ``j`` of ``parts[m]``
    (gate, up -> gate_0, up_0, gate_1, up_1, ...); one tensor is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    return torch.stack(list(parts), dim=1).flatten(0, 1)


def is_layer_pattern(pattern: str) -> bool:
    """Whether a table name is per-layer (contains ``{i}``)."""
    return "{i}" in pattern


def is_expert_pattern(pattern: str) -> bool:
    """Whether a table name is per-expert (contains ``{e}``)."""
    return "{e}" in pattern


# ---------------------------------------------------------------------------------------------
# HF config readers shared by several families: RoPE settings, per-layer-type RoPE, windows.
# ---------------------------------------------------------------------------------------------


def rope_parameters(hf) -> dict:
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
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_rope(hf, name: str) -> tuple[float, float | None, float | None]:
    """(theta, Llama-3 scaling factor, linear scaling factor) of a Llama-family config."""
    rope = rope_parameters(hf)
    rope_type = rope["rope_type"]
    scaling_factor = linear_factor = None
    if rope_type == "llama3":
        for key, value in LLAMA3_FIXED.items():
            if float(rope.get(key, value)) != value:
                raise ValueError(
                    f"{name}: rope scaling {key}={rope[key]} is not supported; megatron-core's "
                    f"Llama-3 RoPE scaling fixes it to {value}"
                )
        scaling_factor = float(rope["factor"])
    elif rope_type == "linear":  # Llama-2 style position interpolation
        linear_factor = float(rope["factor"])
    elif rope_type != "default":
        raise ValueError(
            f"{name}: rope_type={rope_type!r} is not supported (supported: default, linear, llama3)"
        )
    return float(rope["rope_theta"]), scaling_factor, linear_factor


def per_layer_type_rope(hf, name: str) -> dict:
    """A config whose ``rope_parameters`` may be keyed by layer type (OLMo 3, Gemma 3) reduced
    to one RoPE for every layer.

    Raises:
        ValueError: the layer types' RoPE settings differ (megatron-core builds one rotary table
            per model).
    """
    params = getattr(hf, "rope_parameters", None) or {}
    by_type = {k: v for k, v in params.items() if k in ("full_attention", "sliding_attention")}
    if not by_type:
        return params
    distinct = {tuple(sorted(v.items())) for v in by_type.values()}
    if len(distinct) > 1:
        raise ValueError(
            f"{name}: rope_parameters differ between layer types ({by_type}); one RoPE for "
            "every layer is supported"
        )
    return next(iter(by_type.values()))


YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}
"""HF's YaRN defaults where a config omits the key."""


def yarn_fields(rope: dict, name: str) -> dict:
    """``rope_yarn_*`` fields of a ``rope_type: yarn`` config (DeepSeek-V3, gpt-oss), from
    :func:`rope_parameters`; ``truncate`` defaults to true as in transformers.

    Raises:
        ValueError: what megatron-core's YaRN computes differently: an explicit
            ``attention_factor``, no ``factor``, a partial rotary factor, or ``mscale`` other than
            1 without ``mscale_all_dim`` (transformers then ignores ``mscale``).
    """
    for key, allowed in (("attention_factor", (None,)), ("partial_rotary_factor", (None, 1.0))):
        if rope.get(key) not in allowed:
            raise ValueError(
                f"{name}: rope_parameters.{key}={rope[key]} is not supported with YaRN "
                "(megatron-core derives the attention factor from factor / mscale / "
                "mscale_all_dim and rotates every rope dimension)"
            )
    if rope.get("factor") is None:
        raise ValueError(f"{name}: rope_parameters.factor is required with rope_type=yarn")
    mscale = float(rope.get("mscale") or 1.0)
    mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
    if mscale != 1.0 and not mscale_all_dim:
        raise ValueError(
            f"{name}: rope_parameters.mscale={mscale} without mscale_all_dim is not supported "
            "(transformers ignores it there, megatron-core applies it)"
        )
    return dict(
        rope_yarn_factor=float(rope["factor"]),
        rope_yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        rope_yarn_beta_fast=float(rope.get("beta_fast") or YARN_DEFAULTS["beta_fast"]),
        rope_yarn_beta_slow=float(rope.get("beta_slow") or YARN_DEFAULTS["beta_slow"]),
        rope_yarn_mscale=mscale,
        rope_yarn_mscale_all_dim=mscale_all_dim,
        rope_yarn_truncate=bool(rope.get("truncate", True)),
    )


def yarn_rope_to_hf(cfg: ModelConfig) -> dict:
    """HF ``rope_parameters`` of a model with plain or YaRN RoPE (the inverse of
    :func:`yarn_fields`)."""
    if cfg.rope_yarn_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rotary_base,
        "factor": cfg.rope_yarn_factor,
        "original_max_position_embeddings": cfg.rope_yarn_original_max_position_embeddings,
        "beta_fast": cfg.rope_yarn_beta_fast,
        "beta_slow": cfg.rope_yarn_beta_slow,
        "mscale": cfg.rope_yarn_mscale,
        "mscale_all_dim": cfg.rope_yarn_mscale_all_dim,
        "truncate": cfg.rope_yarn_truncate,
    }


def sliding_window_fields(hf) -> dict:
    """``sliding_window`` / ``sliding_window_layers`` of a config whose ``layer_types`` marks the
    windowed layers ``sliding_attention`` (the others ``full_attention``); empty without any."""
    types = list(getattr(hf, "layer_types", None) or [])
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{hf.model_type}: layer_types {unknown} are not supported")
    windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not windowed or not getattr(hf, "sliding_window", None):
        return {}
    every = len(windowed) == hf.num_hidden_layers
    return dict(
        sliding_window=int(hf.sliding_window), sliding_window_layers=None if every else windowed
    )


def hf_layer_types(cfg: ModelConfig) -> list[str] | None:
    """HF ``layer_types`` of a ModelConfig with a sliding window (None without one)."""
    if cfg.sliding_window is None:
        return None
    windowed = set(
        range(cfg.num_layers) if cfg.sliding_window_layers is None else cfg.sliding_window_layers
    )
    return [
        "sliding_attention" if i in windowed else "full_attention" for i in range(cfg.num_layers)
    ]


def decoder_dims(hf) -> dict:
    """The sizes a Llama-style decoder's Hugging Face config states under the same names: layers,
    widths, heads (grouped query heads: ``num_key_value_heads``, default all), head size
    (``head_dim``, default hidden / heads), vocabulary and positions, as ``ModelConfig`` fields."""
    heads = hf.num_attention_heads
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
    )


def post_norm_tensors() -> list[TensorMap]:
    """The norms after attention and after the MLP (OLMo 3's post-norms, Gemma 3's sandwich
    norms' second halves): one replicated [hidden] weight each per layer, HF
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``."""
    d, p = "decoder.layers.{i}.", "model.layers.{i}."
    return [
        TensorMap(d + name, (p + hf_name,), REPLICATED, (("hidden",),))
        for name, hf_name in (
            ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
            ("post_mlp_layernorm.weight", "post_feedforward_layernorm.weight"),
        )
    ]
