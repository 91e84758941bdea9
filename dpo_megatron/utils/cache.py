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

CACHE_VERSION = 4
"""Format version of every cache entry: bump it when what a cached entry holds (or how it is
computed) changes, so earlier entries are no longer found."""


def cache_root() -> Path:
    """``$DPO_MEGATRON_CACHE`` if set, else ``~/.cache/dpo_megatron`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dpo_megatron"


def content_key(fields: dict[str, Any]) -> str:
    """Hex sha256 of ``fields`` plus :data:`CACHE_VERSION`, as canonical JSON (sorted keys;
    values JSON cannot hold are written with ``str``): equal inputs give equal keys on every
    machine, any changed value another key."""
    key = {"version": CACHE_VERSION, **fields}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
