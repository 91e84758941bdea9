"""One table per Hugging Face architecture: HF tensor names <-> megatron-core names, and how each
tensor is split across tensor-parallel ranks; plus the HF config.json <-> ModelConfig translation.

Adding an architecture means adding an :class:`Architecture` to :data:`ARCHITECTURES` (a
config translator and a tensor table); the loader and exporter have no per-architecture code.

Names use ``{i}`` for the global 0-based layer index and ``{e}`` for the global 0-based expert
index of a mixture-of-experts layer. megatron-core names are those of a ``GPTModel`` built with
the local layer spec of :mod:`dpo_megatron.models.gpt` (norms are their own modules:
``input_layernorm``, ``pre_mlp_layernorm``, ``final_layernorm``; an MoE layer's experts are
``mlp.experts.local_experts.<local index>``, mapped to ``{e}`` by the loader).

Logical shapes are written in megatron's orientation ``[out, in]`` with symbols resolved by
:func:`dims`: ``hidden``, ``ffn``, ``vocab`` (unpadded), ``positions``, ``q`` (heads x head_dim),
``kv`` (key/value heads x head_dim), ``qkv`` (q + 2 kv), ``head_dim``, ``experts``,
``expert_ffn`` (one expert's intermediate width). ``transposed`` tensors are stored by HF as
``[in, out]`` (GPT-2's ``Conv1D``). Tensors of an expert (``{e}`` in the name) are split over the
expert tensor-parallel group instead of the tensor-parallel group.

Supported (``model_type``: classes, what differs):

* ``llama`` (Llama 2 / 3.x incl. ``rope_type: llama3`` and ``linear``, SmolLM2), ``mistral``,
  ``qwen2`` (Qwen2 / Qwen2.5: q/k/v biases): one table.
* ``qwen3`` (``Qwen3ForCausalLM``): the Llama table plus per-head query/key RMSNorm; explicit
  ``head_dim``.
* ``qwen3_moe`` (``Qwen3MoeForCausalLM``) and ``mixtral`` (``MixtralForCausalLM``): the Llama
  attention with an MoE layer (router ``gate`` + per-expert SwiGLU MLPs, the per-expert file
  layout transformers writes and the hub holds).
* ``smollm3`` (``SmolLM3ForCausalLM``): the Llama table; the layers HF's ``no_rope_layers``
  marks 0 apply no RoPE (``model.no_rope_layers``); with ``use_sliding_window`` the
  ``sliding_attention`` layers of ``layer_types`` are windowed (``model.sliding_window``).
* ``olmo3`` (``Olmo3ForCausalLM``): the Llama projections; RMSNorms after attention and MLP
  instead of before (``model.norm_placement=post``); query / key RMSNorm over the whole
  projection (``model.qk_norm_scope=projection``, weights split with the heads); sliding windows
  in the ``sliding_attention`` layers of ``layer_types``; one RoPE for both layer types.
* ``gemma3_text`` (``Gemma3ForCausalLM``): the Llama projections with per-head q/k norms; norms
  before and after attention and MLP (``model.norm_placement=sandwich``), all ``(1 + w)``
  RMSNorms (``model.norm_weight_offset``); GeGLU; embeddings scaled by sqrt(hidden); softmax
  scale ``query_pre_attn_scalar ** -0.5``; sliding windows per ``layer_types`` with their own
  RoPE theta (``model.local_rotary_base``).
* ``gpt2``: learned positions, Conv1D weights.
* ``gpt_neox`` (``GPTNeoXForCausalLM``, Pythia): parallel residual, partial rotary, LayerNorm
  with biases, fused per-head QKV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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


def dims(cfg: ModelConfig) -> dict[str, int]:
    """Values of the shape symbols used in tables, for this config."""
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return {
        "hidden": cfg.hidden_size,
        "ffn": cfg.ffn_hidden_size,
        "expert_ffn": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        "experts": cfg.num_experts or 0,
        "head_dim": head_dim,
        "vocab": cfg.vocab_size,
        "positions": cfg.max_position_embeddings,
        "q": cfg.num_attention_heads * head_dim,
        "kv": groups * head_dim,
        "qkv": (cfg.num_attention_heads + 2 * groups) * head_dim,
    }


# ---------------------------------------------------------------------------------------------
# Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), SmolLM2 (tied embeddings), Qwen3 (q/k
# norms), and the MoE members Qwen3-MoE and Mixtral (same attention, routed experts).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoENames:
    """HF names of one MoE layer's router and expert MLPs (``{i}`` layer, ``{e}`` expert)."""

    router: str
    gate: str
    up: str
    down: str


QWEN3_MOE_NAMES = MoENames(
    router="model.layers.{i}.mlp.gate.weight",
    gate="model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    up="model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    down="model.layers.{i}.mlp.experts.{e}.down_proj.weight",
)
MIXTRAL_NAMES = MoENames(
    router="model.layers.{i}.block_sparse_moe.gate.weight",
    gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
)


def _llama_tensors(cfg: ModelConfig, moe: "MoENames | None" = None) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
    table = [
        TensorMap(
            "embedding.word_embeddings.weight",
            ("model.embed_tokens.weight",),
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
            d + "self_attention.linear_qkv.weight",
            (
                p + "self_attn.q_proj.weight",
                p + "self_attn.k_proj.weight",
                p + "self_attn.v_proj.weight",
            ),
            QKV,
            (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")),
        ),
        TensorMap(
            d + "self_attention.linear_proj.weight",
            (p + "self_attn.o_proj.weight",),
            ROW,
            (("hidden", "q"),),
        ),
        TensorMap(
            d + "pre_mlp_layernorm.weight",
            (p + "post_attention_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            "decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED, (("hidden",),)
        ),
    ]
    if moe is None:
        table += [
            TensorMap(
                d + "mlp.linear_fc1.weight",
                (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                GATE_UP,
                (("ffn", "hidden"), ("ffn", "hidden")),
            ),
            TensorMap(
                d + "mlp.linear_fc2.weight",
                (p + "mlp.down_proj.weight",),
                ROW,
                (("hidden", "ffn"),),
            ),
        ]
    else:
        e = d + "mlp.experts.local_experts.{e}."
        table += [
            # The router is replicated on every rank (TP and EP alike), in the model dtype
            # (megatron-core's TopKRouter computes its logits in fp32: moe_router_dtype).
            TensorMap(d + "mlp.router.weight", (moe.router,), REPLICATED, (("experts", "hidden"),)),
            TensorMap(
                e + "linear_fc1.weight",
                (moe.gate, moe.up),
                GATE_UP,
                (("expert_ffn", "hidden"), ("expert_ffn", "hidden")),
            ),
            TensorMap(e + "linear_fc2.weight", (moe.down,), ROW, (("hidden", "expert_ffn"),)),
        ]
    if cfg.qk_layernorm:  # Qwen3: one RMSNorm weight over head_dim, shared by all heads
        table += [
            TensorMap(
                d + "self_attention.q_layernorm.weight",
                (p + "self_attn.q_norm.weight",),
                REPLICATED,
                (("head_dim",),),
            ),
            TensorMap(
                d + "self_attention.k_layernorm.weight",
                (p + "self_attn.k_norm.weight",),
                REPLICATED,
                (("head_dim",),),
            ),
        ]
    if cfg.add_qkv_bias:
        table.append(
            TensorMap(
                d + "self_attention.linear_qkv.bias",
                (
                    p + "self_attn.q_proj.bias",
                    p + "self_attn.k_proj.bias",
                    p + "self_attn.v_proj.bias",
                ),
                QKV,
                (("q",), ("kv",), ("kv",)),
            )
        )
    if not cfg.tie_word_embeddings:
        table.append(
            TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB, (("vocab", "hidden"),))
        )
    return table


def _qwen3_moe_tensors(cfg: ModelConfig) -> list[TensorMap]:
    return _llama_tensors(cfg, QWEN3_MOE_NAMES)


def _mixtral_tensors(cfg: ModelConfig) -> list[TensorMap]:
    return _llama_tensors(cfg, MIXTRAL_NAMES)


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
_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama_rope(hf, name: str) -> tuple[float, Optional[float], Optional[float]]:
    """(theta, Llama-3 scaling factor, linear scaling factor) of a Llama-family config."""
    rope = _rope_parameters(hf)
    rope_type = rope["rope_type"]
    scaling_factor = linear_factor = None
    if rope_type == "llama3":
        for key, value in _LLAMA3_FIXED.items():
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


def _moe_config_from_hf(hf, name: str) -> dict:
    """MoE fields of a Qwen3-MoE or Mixtral config (empty for dense models).

    Raises:
        ValueError: dense layers interleaved with MoE layers (Qwen3-MoE ``decoder_sparse_step``
            / ``mlp_only_layers``), shared experts, or router jitter (DPO needs the reference
            and the policy to route alike: a random router is not supported).
    """
    if name == "qwen3_moe":
        if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", None):
            raise ValueError(
                f"{name}: decoder_sparse_step={hf.decoder_sparse_step} / "
                f"mlp_only_layers={hf.mlp_only_layers} (dense layers between MoE "
                "layers) is not supported: every layer must be an MoE layer"
            )
        if getattr(hf, "shared_expert_intermediate_size", 0):
            raise ValueError(f"{name}: shared experts are not supported")
        return dict(
            num_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_norm_topk_prob=bool(hf.norm_topk_prob),
            moe_aux_loss_coeff=float(hf.router_aux_loss_coef),
        )
    if name == "mixtral":
        if getattr(hf, "router_jitter_noise", 0.0):
            raise ValueError(
                f"{name}: router_jitter_noise={hf.router_jitter_noise} is not "
                "supported: DPO needs deterministic routing (the reference and the "
                "policy must route alike); set it to 0"
            )
        return dict(
            num_experts=hf.num_local_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size,
            moe_norm_topk_prob=True,
            moe_aux_loss_coeff=float(hf.router_aux_loss_coef),
        )
    return dict(num_experts=None, moe_ffn_hidden_size=None)


def _no_rope_layers(hf) -> Optional[list[int]]:
    """SmolLM3's NoPE layers: the indices where HF's ``no_rope_layers`` holds 0 (HF: 1 = the
    layer applies RoPE; the config fills it from ``no_rope_layer_interval``, every 4th layer
    unrotated)."""
    flags = list(hf.no_rope_layers)
    if len(flags) != hf.num_hidden_layers:
        raise ValueError(
            f"smollm3: no_rope_layers has {len(flags)} entries for "
            f"num_hidden_layers={hf.num_hidden_layers}"
        )
    return [i for i, rotated in enumerate(flags) if not rotated] or None


def _sliding_window_fields(hf) -> dict:
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


def _layer_types(cfg: ModelConfig) -> Optional[list[str]]:
    """HF ``layer_types`` of a ModelConfig with a sliding window (None without one)."""
    if cfg.sliding_window is None:
        return None
    windowed = set(
        range(cfg.num_layers) if cfg.sliding_window_layers is None else cfg.sliding_window_layers
    )
    return [
        "sliding_attention" if i in windowed else "full_attention" for i in range(cfg.num_layers)
    ]


def _llama_config_from_hf(hf) -> dict:
    name = hf.model_type
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError(f"{name}: attention_bias / mlp_bias = true is not supported")
    theta, scaling_factor, linear_factor = _llama_rope(hf, name)
    window = getattr(hf, "sliding_window", None)
    # Qwen2/3 configs carry a window that is off unless use_sliding_window is set.
    windowed = (
        getattr(hf, "use_sliding_window", False)
        if hasattr(hf, "use_sliding_window")
        else window is not None
    )
    sliding = {}
    if name == "smollm3":  # exact: the windowed layers of HF's layer_types
        sliding = _sliding_window_fields(hf) if windowed else {}
    elif window is not None and windowed:
        logger.warning(
            "%s: sliding_window=%s is ignored (full causal attention); outputs differ "
            "from transformers only for sequences longer than the window",
            name,
            window,
        )
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return dict(
        no_rope_layers=_no_rope_layers(hf) if name == "smollm3" else None,
        qk_norm_scope="head",
        norm_placement="pre",
        norm_weight_offset=False,
        embedding_scale=None,
        softmax_scale=None,
        local_rotary_base=None,
        sliding_window=sliding.get("sliding_window"),
        sliding_window_layers=sliding.get("sliding_window_layers"),
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
        kv_channels=head_dim,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling_factor=scaling_factor,
        rope_linear_scaling_factor=linear_factor,
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=name == "qwen2",
        qk_layernorm=name in ("qwen3", "qwen3_moe"),
        parallel_residual=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        **_moe_config_from_hf(hf, name),
    )


def _llama_config_to_hf(cfg: ModelConfig) -> dict:
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rotary_base,
            "factor": cfg.rope_scaling_factor,
            **_LLAMA3_FIXED,
        }
    elif cfg.rope_linear_scaling_factor is not None:
        rope = {
            "rope_type": "linear",
            "rope_theta": cfg.rotary_base,
            "factor": cfg.rope_linear_scaling_factor,
        }
    out = dict(
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=dims(cfg)["head_dim"],
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope,
        rms_norm_eps=cfg.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.no_rope_layers:  # SmolLM3 (HF: 1 = RoPE applied)
        skipped = set(cfg.no_rope_layers)
        out["no_rope_layers"] = [int(i not in skipped) for i in range(cfg.num_layers)]
    if cfg.sliding_window is not None:  # SmolLM3
        out.update(
            use_sliding_window=True,
            sliding_window=cfg.sliding_window,
            layer_types=_layer_types(cfg),
        )
    if cfg.num_experts:
        out.update(
            num_experts_per_tok=cfg.moe_router_topk,
            router_aux_loss_coef=cfg.moe_aux_loss_coeff or 0.0,
        )
        if cfg.qk_layernorm:  # Qwen3-MoE
            out.update(
                num_experts=cfg.num_experts,
                norm_topk_prob=cfg.moe_norm_topk_prob,
                moe_intermediate_size=dims(cfg)["expert_ffn"],
            )
        else:  # Mixtral: experts are intermediate_size wide
            out.update(num_local_experts=cfg.num_experts, intermediate_size=dims(cfg)["expert_ffn"])
    return out


# ---------------------------------------------------------------------------------------------
# OLMo 3: the Llama projections, norms after attention and MLP (none before), query / key
# RMSNorm over the whole projection, sliding windows in three of every four layers.
# ---------------------------------------------------------------------------------------------


def _olmo3_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
    pre_norms = (d + "input_layernorm.weight", d + "pre_mlp_layernorm.weight")
    qk_norms = (d + "self_attention.q_layernorm.weight", d + "self_attention.k_layernorm.weight")
    table = [t for t in _llama_tensors(cfg) if t.megatron not in pre_norms + qk_norms]
    return table + [
        TensorMap(
            d + "post_attention_layernorm.weight",
            (p + "post_attention_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "post_mlp_layernorm.weight",
            (p + "post_feedforward_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        # One weight over all heads, split with the heads (models.norms.ProjectionRMSNorm).
        TensorMap(qk_norms[0], (p + "self_attn.q_norm.weight",), COLUMN, (("q",),)),
        TensorMap(qk_norms[1], (p + "self_attn.k_norm.weight",), COLUMN, (("kv",),)),
    ]


def _per_layer_type_rope(hf, name: str) -> dict:
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


def _olmo3_config_from_hf(hf) -> dict:
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"olmo3: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_bias", False):
        raise ValueError("olmo3: attention_bias=true is not supported")

    class _Flat:  # the one RoPE, read by the Llama-family RoPE rules
        rope_parameters = _per_layer_type_rope(hf, "olmo3")

    theta, scaling_factor, linear_factor = _llama_rope(_Flat, "olmo3")
    heads = hf.num_attention_heads
    sliding = _sliding_window_fields(hf)
    return dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
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


def _olmo3_config_to_hf(cfg: ModelConfig) -> dict:
    out = _llama_config_to_hf(cfg)
    rope = out.pop("rope_parameters")
    out.pop("head_dim")
    out["rope_parameters"] = {"full_attention": rope, "sliding_attention": dict(rope)}
    out["sliding_window"] = cfg.sliding_window
    out["layer_types"] = _layer_types(cfg) or ["full_attention"] * cfg.num_layers
    out.pop("use_sliding_window", None)
    return out


# ---------------------------------------------------------------------------------------------
# Gemma 3 (text): sandwich norms with (1 + w) RMSNorm, per-head q/k norms, GeGLU, scaled
# embeddings, sliding windows in five of every six layers with their own RoPE theta.
# ---------------------------------------------------------------------------------------------


def _gemma3_tensors(cfg: ModelConfig) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
    renamed = {
        d + "pre_mlp_layernorm.weight": p + "pre_feedforward_layernorm.weight",
    }
    table = [
        TensorMap(t.megatron, (renamed[t.megatron],), t.split, t.shapes)
        if t.megatron in renamed
        else t
        for t in _llama_tensors(cfg)
    ]
    return table + [
        TensorMap(
            d + "post_attention_layernorm.weight",
            (p + "post_attention_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "post_mlp_layernorm.weight",
            (p + "post_feedforward_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
    ]


def _gemma3_config_from_hf(hf) -> dict:
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

    theta, scaling_factor, linear_factor = _llama_rope(_Full, name)
    local = params.get("sliding_attention") or {}
    if local and local.get("rope_type", "default") != "default":
        raise ValueError(
            f"{name}: rope_parameters.sliding_attention.rope_type="
            f"{local['rope_type']!r} is not supported (default)"
        )
    sliding = _sliding_window_fields(hf)
    local_theta = float(local.get("rope_theta", theta))
    differs = local_theta != theta or scaling_factor or linear_factor
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


def _gemma3_config_to_hf(cfg: ModelConfig) -> dict:
    out = _llama_config_to_hf(cfg)
    full = out.pop("rope_parameters")
    local = {"rope_type": "default", "rope_theta": cfg.local_rotary_base or cfg.rotary_base}
    out.pop("hidden_act")
    out.update(
        rope_parameters={"full_attention": full, "sliding_attention": local},
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=round((cfg.softmax_scale or dims(cfg)["head_dim"] ** -0.5) ** -2),
        sliding_window=cfg.sliding_window,
        layer_types=_layer_types(cfg) or ["full_attention"] * cfg.num_layers,
    )
    out.pop("use_sliding_window", None)
    return out


# ---------------------------------------------------------------------------------------------
# GPT-2: learned positions, LayerNorm, GELU (tanh), biases everywhere, tied, Conv1D weights.
# ---------------------------------------------------------------------------------------------


def _gpt2_tensors(cfg: ModelConfig) -> list[TensorMap]:
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


def _gpt2_config_from_hf(hf) -> dict:
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


def _gpt2_config_to_hf(cfg: ModelConfig) -> dict:
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


# ---------------------------------------------------------------------------------------------
# GPT-NeoX (Pythia): parallel residual, partial rotary, LayerNorm and linear biases, untied.
# ---------------------------------------------------------------------------------------------


def _gpt_neox_tensors(cfg: ModelConfig) -> list[TensorMap]:
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


def _gpt_neox_config_from_hf(hf) -> dict:
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
    rope = _rope_parameters(hf)
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


def _gpt_neox_config_to_hf(cfg: ModelConfig) -> dict:
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


_LLAMA_IGNORED = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "llama",
        "LlamaForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _llama_tensors,
        "model.",
        _LLAMA_IGNORED,
    ),
    "mistral": Architecture(
        "mistral",
        "MistralForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _llama_tensors,
        "model.",
        _LLAMA_IGNORED,
    ),
    "qwen2": Architecture(
        "qwen2",
        "Qwen2ForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _llama_tensors,
        "model.",
        _LLAMA_IGNORED,
    ),
    "qwen3": Architecture(
        "qwen3",
        "Qwen3ForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _llama_tensors,
        "model.",
    ),
    # SmolLM3: the Llama table; every no_rope_layer_interval-th layer applies no RoPE.
    "smollm3": Architecture(
        "smollm3",
        "SmolLM3ForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _llama_tensors,
        "model.",
    ),
    "qwen3_moe": Architecture(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _qwen3_moe_tensors,
        "model.",
    ),
    "mixtral": Architecture(
        "mixtral",
        "MixtralForCausalLM",
        _llama_config_from_hf,
        _llama_config_to_hf,
        _mixtral_tensors,
        "model.",
        _LLAMA_IGNORED,
    ),
    "olmo3": Architecture(
        "olmo3",
        "Olmo3ForCausalLM",
        _olmo3_config_from_hf,
        _olmo3_config_to_hf,
        _olmo3_tensors,
        "model.",
    ),
    "gemma3_text": Architecture(
        "gemma3_text",
        "Gemma3ForCausalLM",
        _gemma3_config_from_hf,
        _gemma3_config_to_hf,
        _gemma3_tensors,
        "model.",
    ),
    "gpt2": Architecture(
        "gpt2",
        "GPT2LMHeadModel",
        _gpt2_config_from_hf,
        _gpt2_config_to_hf,
        _gpt2_tensors,
        "transformer.",
        ("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias"),
    ),
    # Checkpoints written by older transformers (the Pythia files on the hub) also hold the
    # causal-mask and rotary buffers.
    "gpt_neox": Architecture(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        _gpt_neox_config_from_hf,
        _gpt_neox_config_to_hf,
        _gpt_neox_tensors,
        "gpt_neox.",
        (
            "gpt_neox.layers.{i}.attention.bias",
            "gpt_neox.layers.{i}.attention.masked_bias",
            "gpt_neox.layers.{i}.attention.rotary_emb.inv_freq",
        ),
    ),
}


def get_architecture(model_type: str, source: str = "config.json") -> Architecture:
    """The table for HF ``model_type``.

    Raises:
        ValueError: naming the unknown type, where it came from, and the supported ones.
    """
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{source}: unknown architecture model_type={model_type!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]


def expand(pattern: str, layer: int | None, expert: int | None = None) -> str:
    """A table name with ``{i}`` replaced by the layer index and ``{e}`` by the expert index
    (names without them unchanged)."""
    if layer is not None:
        pattern = pattern.replace("{i}", str(layer))
    if expert is not None:
        pattern = pattern.replace("{e}", str(expert))
    return pattern


def is_layer_pattern(pattern: str) -> bool:
    """Whether a table name is per-layer (contains ``{i}``)."""
    return "{i}" in pattern


def is_expert_pattern(pattern: str) -> bool:
    """Whether a table name is per-expert (contains ``{e}``)."""
    return "{e}" in pattern
