"""Model presets: the reference DPO repo's model names (Rafailov et al. 2023, ``model=pythia28``)
-> the Hugging Face model they name, with its architecture facts.

The reference repo selects a model with a short name (``config/model/pythia28.yaml``:
``name_or_path: EleutherAI/pythia-2.8b``). :data:`PRESETS` is that table for the names whose
architecture this engine maps, plus the smaller Pythia models (70m .. 1.4b) that the same
recipe runs on one machine. :func:`resolve_model_preset` turns a preset name into what
``model.hf_path`` takes: a local folder holding that model when one is found (machines without
hub access), else the hub name.

Usage (a config hook or a CLI)::

    from dpo_megatron.models.presets import resolve_model_preset
    cfg.model.hf_path = resolve_model_preset("pythia28")   # "EleutherAI/pythia-2.8b" or a folder
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

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


def _pythia(size: str, layers: int, hidden: int, heads: int, vocab: int = 50304) -> ModelPreset:
    """Pythia (Biderman et al. 2023, table 1): GPT-NeoX, ffn = 4 x hidden, untied."""
    return ModelPreset(f"EleutherAI/pythia-{size}", "gpt_neox", layers, hidden, heads,
                       4 * hidden, vocab, size)


PRESETS: dict[str, ModelPreset] = {
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
}
"""Preset name -> model. The reference repo's ``gptj`` is absent: GPT-J is not mapped."""


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``.

    Raises:
        ValueError: an unknown name (lists the presets).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def _search_dirs(search_dirs: Optional[Sequence[str]]) -> list[str]:
    if search_dirs is not None:
        return list(search_dirs)
    return [d for d in os.environ.get(MODELS_DIR_ENV, "").split(os.pathsep) if d]


def _check_folder(folder: str, name: str, preset: ModelPreset) -> None:
    """A local copy must be the preset's model (its config.json states the same facts)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    facts = {"model_type": preset.model_type,
             ("num_hidden_layers", "n_layer"): preset.num_layers,
             ("hidden_size", "n_embd"): preset.hidden_size,
             ("num_attention_heads", "n_head"): preset.num_attention_heads}
    for keys, want in facts.items():
        keys = keys if isinstance(keys, tuple) else (keys,)
        got = next((config[k] for k in keys if k in config), None)
        if got != want:
            raise ValueError(f"{folder}/config.json: {keys[0]}={got!r}, but preset {name!r} "
                             f"({preset.hub_name}) has {want!r}: the folder holds another model")


def resolve_model_preset(name: str, search_dirs: Optional[Sequence[str]] = None) -> str:
    """What ``model.hf_path`` should be for a preset: a local folder holding the preset's model,
    else its hub name.

    Args:
        name: a key of :data:`PRESETS` (``pythia28``).
        search_dirs: folders to look in for ``<dir>/<hub name>`` or ``<dir>/<last part of the hub
            name>`` with a config.json (default: ``$DPO_MEGATRON_MODELS``; ``[]``: none).

    Returns:
        The local folder, or the hub name (``EleutherAI/pythia-2.8b``).

    Raises:
        ValueError: an unknown preset (lists them), or a local folder whose config.json describes
            another model.
    """
    preset = get_preset(name)
    for root in _search_dirs(search_dirs):
        for candidate in (preset.hub_name, preset.hub_name.rsplit("/", 1)[-1]):
            folder = os.path.join(root, candidate)
            if os.path.isfile(os.path.join(folder, "config.json")):
                _check_folder(folder, name, preset)
                return folder
    return preset.hub_name
