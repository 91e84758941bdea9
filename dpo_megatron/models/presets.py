"""Model presets, the one table behind ``model=NAME``: the reference DPO repo's model names
(Rafailov et al. 2023, ``model=pythia28``) and this project's offline models -> the Hugging Face
model they name, with its architecture facts.

The reference repo selects a model with a short name (``config/model/pythia28.yaml``:
``name_or_path: EleutherAI/pythia-2.8b``). :data:`MODEL_PRESETS` is that table for the names
whose architecture this engine maps, plus the smaller Pythia models (70m .. 1.4b) that the same
recipe runs on one machine, plus ``smollm2`` (the cached offline SmolLM2-135M-Instruct). A preset
is also found by its hub name's last part (``pythia-70m``, ``pythia-2.8b``).

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
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

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
    vocab_size: int
    parameters: str
    """Approximate size, as the model's name states it."""
    asset: str = ""
    """Offline asset holding the model (a key of ``dpo_megatron.utils.cache.ASSET_PATHS``);
    ``model=NAME`` then sets ``model.hf_path=${asset:<asset>}``, resolved when the config is."""
    model_keys: dict[str, Any] = field(default_factory=dict, hash=False)
    """Further ``model.*`` keys the preset sets (SmolLM2: ``pad_attention_heads``)."""


def _pythia(size: str, layers: int, hidden: int, heads: int, vocab: int = 50304) -> ModelPreset:
    """Pythia (Biderman et al. 2023, table 1): GPT-NeoX, ffn = 4 x hidden, untied."""
    return ModelPreset(
        f"EleutherAI/pythia-{size}", "gpt_neox", layers, hidden, heads, 4 * hidden, vocab, size
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
}
"""Preset name -> model. The reference repo's ``gptj`` is absent: GPT-J is not mapped."""


def preset_name(name: str) -> Optional[str]:
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


def _search_dirs(search_dirs: Optional[Sequence[str]]) -> list[str]:
    if search_dirs is not None:
        return list(search_dirs)
    return [d for d in os.environ.get(MODELS_DIR_ENV, "").split(os.pathsep) if d]


def _check_folder(folder: str, name: str, preset: ModelPreset) -> None:
    """A local copy must be the preset's model (its config.json states the same facts)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    facts = {
        "model_type": preset.model_type,
        ("num_hidden_layers", "n_layer"): preset.num_layers,
        ("hidden_size", "n_embd"): preset.hidden_size,
        ("num_attention_heads", "n_head"): preset.num_attention_heads,
    }
    for keys, want in facts.items():
        keys = keys if isinstance(keys, tuple) else (keys,)
        got = next((config[k] for k in keys if k in config), None)
        if got != want:
            raise ValueError(
                f"{folder}/config.json: {keys[0]}={got!r}, but preset {name!r} "
                f"({preset.hub_name}) has {want!r}: the folder holds another model"
            )


def resolve_model_preset(name: str, search_dirs: Optional[Sequence[str]] = None) -> str:
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


def _local_copy(name: str, preset: ModelPreset, search_dirs: Optional[Sequence[str]]) -> str:
    for root in _search_dirs(search_dirs):
        for candidate in (preset.hub_name, preset.hub_name.rsplit("/", 1)[-1]):
            folder = os.path.join(root, candidate)
            if os.path.isfile(os.path.join(folder, "config.json")):
                _check_folder(folder, name, preset)
                return folder
    return ""


def model_preset_keys(name: str, search_dirs: Optional[Sequence[str]] = None) -> dict[str, Any]:
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
