"""The offline cache: where it lives, how its entries are keyed, and the one format version.

The tokenization cache (``<root>/data``), the reference log-prob tables
(``<root>/reference_logps``) and the offline assets (``scripts/assets.py``) all live under
:func:`cache_root`. Each cache entry is named by a :func:`content_key` of everything its content
depends on, including :data:`CACHE_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CACHE_ENV = "DPO_MEGATRON_CACHE"
"""Environment variable that moves the cache (default ``~/.cache/dpo_megatron``)."""

CACHE_VERSION = 7
"""Format version of every cache entry: bump it when what a cached entry holds (or how it is
computed) changes, so earlier entries are no longer found (5: the tokenization key holds the
item kind's ``reads_rejected`` instead of an ``sft`` flag; 6: tokenized rows hold the row's
``margin``; 7: UltraFeedback rows hold the ``prompt_differs`` note)."""


def cache_root() -> Path:
    """``$DPO_MEGATRON_CACHE`` if set, else ``~/.cache/dpo_megatron`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dpo_megatron"


ASSET_PATHS = {
    "smollm2": "smollm2-135m-instruct",
    "dpo_en_demo": "llamafactory-0.9.5/dpo_en_demo.json",
    "dpo_zh_demo": "llamafactory-0.9.5/dpo_zh_demo.json",
    "alpaca_en_demo": "llamafactory-0.9.5/alpaca_en_demo.json",
    "kto_en_demo": "llamafactory-0.9.5/kto_en_demo.json",
    "sentencepiece": "mistral-sentencepiece/tokenizer.model",
    "word_count_prompts": "generated/word_count_prompts.jsonl",
}
"""The offline assets (``${asset:NAME}`` in a config): name -> path under :func:`cache_root`.
``scripts/assets.py`` builds them there (``scripts/setup.sh`` runs it); a run only looks."""


def asset_path(name: str) -> Path:
    """The cached offline asset ``name`` (a key of :data:`ASSET_PATHS`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        FileNotFoundError: the asset is not built yet (the message says how to build it).
    """
    if name not in ASSET_PATHS:
        raise ValueError(f"unknown asset {name!r}; known: {sorted(ASSET_PATHS)}")
    path = cache_root() / ASSET_PATHS[name]
    if not path.exists():
        raise FileNotFoundError(
            f"asset {name!r} is not in the cache ({path}): build it with "
            f"`python scripts/assets.py {name}` (scripts/setup.sh builds them all)"
        )
    return path


def content_key(fields: dict[str, Any]) -> str:
    """Hex sha256 of ``fields`` plus :data:`CACHE_VERSION`, as canonical JSON (sorted keys;
    values JSON cannot hold are written with ``str``): equal inputs give equal keys on every
    machine, any changed value another key."""
    key = {"version": CACHE_VERSION, **fields}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
