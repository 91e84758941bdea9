"""HF ``config.json`` <-> :class:`ModelConfig`: users never restate the architecture by hand."""

from __future__ import annotations

import dataclasses
import json
import os

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures import (
    ARCHITECTURES,
    Architecture,
    get_architecture,
)
from dpo_megatron.models.quantized import refuse_quantized

HF_DEFAULTED_FIELDS = ("moe_aux_loss_coeff",)
"""ModelConfig fields whose None means "the HF config's value" (``router_aux_loss_coef``)."""

FAMILY_FIELDS = (
    "attention_sinks",
    "swiglu_limit",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_yarn_factor",
    "rope_yarn_original_max_position_embeddings",
    "rope_yarn_beta_fast",
    "rope_yarn_beta_slow",
    "rope_yarn_mscale",
    "rope_yarn_mscale_all_dim",
    "rope_yarn_truncate",
    "moe_first_dense_layers",
    "moe_shared_expert_ffn_hidden_size",
    "moe_router_score_function",
    "moe_router_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_routed_scaling_factor",
)
"""Architecture fields only some translations state (DeepSeek-V3's MLA and routing, gpt-oss's
sinks and clamped SwiGLU, YaRN): the other families' folders get their defaults (a base
config's values never leak into another architecture)."""


def hub_name_hint(hf_path: str) -> str:
    """What to do when ``hf_path`` is not a folder but looks like a hub name (what a preset
    resolves to without a local copy; the engine reads local folders only): '' otherwise."""
    name = hf_path.strip("/")
    local = hf_path.startswith(("/", ".", "~")) or name.count("/") != 1
    if os.path.isdir(hf_path) or local or os.path.isdir(name.split("/")[0]):
        return ""  # a path (absolute, relative, or under a local folder), not ORG/NAME
    from dpo_megatron.models.presets import hub_note

    # A preset whose hub folder the engine cannot read as downloaded (quantized) has its own
    # recipe for the local copy instead of the plain download.
    return f"; {hf_path!r} looks like a hub name: " + (
        hub_note(hf_path.strip("/"))
        or f"download it (hf download {hf_path} --local-dir DIR/{hf_path}) and set "
        f"DPO_MEGATRON_MODELS=DIR or model.hf_path=DIR/{hf_path}"
    )


def read_hf_config_json(hf_path: str) -> dict:
    """The raw ``config.json`` of an HF folder; for the hub name of a preset that stores its
    architecture (``models.presets.ModelPreset.architecture``) and has no folder here, those
    stored keys (the architecture is known offline; the weights still need a local copy).

    Raises:
        FileNotFoundError: the folder or its config.json does not exist.
    """
    path = os.path.join(hf_path, "config.json")
    if not os.path.isfile(path):
        from dpo_megatron.models.presets import stored_architecture

        stored = None if os.path.isdir(hf_path) else stored_architecture(hf_path.strip("/"))
        if stored is not None:
            return stored
        raise FileNotFoundError(
            f"{path}: no config.json (model.hf_path must be a Hugging Face model folder)"
            f"{hub_name_hint(hf_path)}"
        )
    with open(path) as f:
        return json.load(f)


def architecture_of(hf_path: str) -> Architecture:
    """The conversion table for the folder's ``model_type``.

    Raises:
        ValueError: unknown architecture (names it and the supported ones).
    """
    raw = read_hf_config_json(hf_path)
    return get_architecture(
        raw.get("model_type", "<missing>"), os.path.join(hf_path, "config.json")
    )


def head_of(hf_path: str) -> str:
    """``ModelConfig.head`` of an HF folder: "reward" for a ``*ForSequenceClassification``
    (``architectures`` in config.json) with one label, "lm" otherwise.

    Raises:
        ValueError: a sequence classifier with more than one label (not a reward model).
    """
    raw = read_hf_config_json(hf_path)
    classes = raw.get("architectures") or []
    if not any(str(c).endswith("ForSequenceClassification") for c in classes):
        return "lm"
    labels = raw.get("num_labels", len(raw.get("id2label") or {0: None}))
    if labels != 1:
        raise ValueError(
            f"{os.path.join(hf_path, 'config.json')}: {classes[0]} with num_labels={labels}; "
            "a reward model has num_labels=1"
        )
    return "reward"


def model_config_from_hf(hf_path: str, base: ModelConfig | None = None) -> ModelConfig:
    """A ModelConfig whose architecture fields come from ``hf_path/config.json``.

    ``base`` supplies the non-architecture fields (params_dtype, transformer_impl, recompute_*,
    make_vocab_size_divisible_by, init_method_std, load, moe_token_dispatcher); its architecture
    fields are replaced. Fields the HF config only gives a default for
    (:data:`HF_DEFAULTED_FIELDS`: the MoE load-balancing coefficient) keep the base's value
    when it is set. ``hf_path`` is kept in the result; ``head`` is the folder's
    (:func:`head_of`).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: unknown architecture, a quantized checkpoint (with the dequantize recipe:
            ``models.quantized``), or a setting megatron-core cannot represent (names it).
    """
    arch = architecture_of(hf_path)
    from transformers import AutoConfig

    # transformers resolves class defaults and old/new spellings (rope_theta/rope_scaling vs
    # rope_parameters), as from_pretrained does with a folder's file; nothing is downloaded.
    raw = read_hf_config_json(hf_path)
    hf = AutoConfig.for_model(**raw) if "model_type" in raw else AutoConfig.from_pretrained(hf_path)
    refuse_quantized(hf, hf_path)  # every architecture: the weights are read unquantized
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    fields = {**{name: defaults[name] for name in FAMILY_FIELDS}, **arch.config_from_hf(hf)}
    base = base or ModelConfig()
    for name in HF_DEFAULTED_FIELDS:
        if getattr(base, name) is not None:
            fields.pop(name, None)
    return dataclasses.replace(base, hf_path=hf_path, head=head_of(hf_path), **fields)


def architecture_fields(model_type: str) -> frozenset[str]:
    """The ModelConfig fields a folder of this ``model_type`` decides (what
    :func:`model_config_from_hf` replaces): those its translation sets, read off transformers'
    config class for the type (its defaults: no folder, no download), and
    :data:`FAMILY_FIELDS`. The rest (dtype, recompute, implementation, ...) are the run's.

    Raises:
        ValueError: an architecture the engine does not map.
    """
    from transformers import AutoConfig

    arch = get_architecture(model_type, "model_type")
    return frozenset(arch.config_from_hf(AutoConfig.for_model(model_type))) | set(FAMILY_FIELDS)


def infer_architecture(cfg: ModelConfig) -> Architecture:
    """The architecture of a ModelConfig with no source folder (for export): GPT-2 for learned
    positions, GPT-NeoX for LayerNorm with RoPE, DeepSeek-V3 for multi-latent attention, OLMo 3
    for post-norms, gpt-oss for attention sinks, Qwen3-MoE / Mixtral for experts with / without
    query-key norms, Qwen3 for query-key norms, SmolLM3 for NoPE layers, Qwen2 for q/k/v-only
    biases, else Llama."""
    if cfg.hf_path and os.path.isfile(os.path.join(cfg.hf_path, "config.json")):
        return architecture_of(cfg.hf_path)
    if cfg.position_embedding_type == "learned_absolute":
        return ARCHITECTURES["gpt2"]
    if cfg.normalization == "LayerNorm":
        return ARCHITECTURES["gpt_neox"]
    if cfg.kv_lora_rank is not None:
        return ARCHITECTURES["deepseek_v3"]
    if cfg.norm_placement == "sandwich":
        return ARCHITECTURES["gemma3_text"]
    if cfg.norm_placement == "post":
        return ARCHITECTURES["olmo3"]
    if cfg.attention_sinks:
        return ARCHITECTURES["gpt_oss"]
    if cfg.num_experts:
        return ARCHITECTURES["qwen3_moe" if cfg.qk_layernorm else "mixtral"]
    if cfg.qk_layernorm:
        return ARCHITECTURES["qwen3"]
    if cfg.no_rope_layers:
        return ARCHITECTURES["smollm3"]
    return ARCHITECTURES["qwen2" if cfg.add_qkv_bias else "llama"]


def hf_config_dict(cfg: ModelConfig, dtype: str) -> dict:
    """config.json content for an export: the source folder's config.json when there is one
    (architecture fields checked against ``cfg``), else one built from ``cfg``; ``dtype`` set.

    Raises:
        ValueError: the source config.json describes a different architecture than ``cfg``.
    """
    arch = infer_architecture(cfg)
    if cfg.hf_path and os.path.isfile(os.path.join(cfg.hf_path, "config.json")):
        raw = read_hf_config_json(cfg.hf_path)
        derived = model_config_from_hf(cfg.hf_path, cfg)
        diff = [
            f.name
            for f in dataclasses.fields(ModelConfig)
            if getattr(derived, f.name) != getattr(cfg, f.name) and f.name != "head"
        ]
        if diff:
            raise ValueError(
                f"{cfg.hf_path}/config.json differs from the model being exported in {diff}"
            )
    else:
        from transformers import AutoConfig

        raw = AutoConfig.for_model(arch.name, **arch.config_to_hf(cfg)).to_dict()
    raw["architectures"] = [arch.hf_class_for(cfg.head)]
    raw["model_type"] = arch.name
    if cfg.head == "reward":  # *ForSequenceClassification reads its label count from these
        raw["num_labels"] = 1
        raw["id2label"], raw["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        raw.pop("problem_type", None)
    raw.pop("torch_dtype", None)
    raw["dtype"] = dtype
    return raw
