"""The tokenization cache: the key of a source's tokenized rows, where they lie, and their IO.

The key is a sha256 over the data's identity (local files: path, size, modification time; a hub
or saved dataset: its fingerprint), the format, the item kind's token-affecting choice (whether
the rejected side is tokenized), the tokenizer's fingerprint, the chat template and the settings
that change tokens. An entry is a ``datasets`` folder written to a temporary name and renamed into
place, so readers never see half of one; an unwritable cache only costs speed.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

from dpo_megatron.data.config import DataConfig
from dpo_megatron.data.encode import EncodeSettings
from dpo_megatron.data.kinds import ItemKind
from dpo_megatron.data.read import ReadSource
from dpo_megatron.data.sources import Source
from dpo_megatron.data.tokenizer import tokenizer_fingerprint
from dpo_megatron.utils.cache import cache_root, content_key
from dpo_megatron.utils.files import atomic_dir

logger = logging.getLogger(__name__)

TOKENIZE_FIELDS = (
    "on_error",
    "shp_min_score_ratio",
    "se_max_pairs_per_question",
    "max_length",
    "max_prompt_length",
    "truncation_mode",
)
"""``data.*`` settings that change the tokenized rows. The length limits do since the encoder
drops whole turns and bounds huge texts before tokenizing; their token cuts still apply after
the cache (``selection``)."""


def source_identity(source: Source) -> dict | list:
    """What identifies a source's data: its files' paths, sizes and times, else its name and
    the dataset's fingerprint; with the rows kept of a sliced split."""
    if source.files:
        stats = [(str(Path(f).resolve()), Path(f).stat()) for f in source.files]
        files = [{"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns} for p, st in stats]
        return files if source.rows is None else {"files": files, "rows": list(source.rows)}
    return {"name": source.label, "fingerprint": getattr(source.dataset, "_fingerprint", None)}


def tokenization_cache_key(
    read: ReadSource, tokenizer, settings: EncodeSettings, cfg: DataConfig, kind: ItemKind
) -> str:
    """:func:`~dpo_megatron.utils.cache.content_key` (sha256 hex, with the cache version) of the
    data's identity, the format, the kind, the tokenizer, the chat template and the
    token-affecting settings."""
    key = {
        "source": source_identity(read.source),
        "malformed": read.source.malformed,
        "format": read.format.name,
        "rejected": kind.reads_rejected,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": {
            k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in asdict(settings).items()
        },
        "config": {k: getattr(cfg, k) for k in TOKENIZE_FIELDS},
    }
    return content_key(key)


def cache_folder(cfg: DataConfig, key: str) -> Path | None:
    """The folder of the entry with ``key`` (``data.cache_dir``, else the engine's cache root's
    ``data``), or None with ``data.cache_dir=none``."""
    if cfg.cache_dir.lower() == "none":
        return None
    if cfg.cache_dir:
        root = Path(cfg.cache_dir).expanduser()
    else:
        root = cache_root() / "data"
    return root / f"tokenized-{key[:32]}"


def load_cached(folder: Path | None):
    """The cached ``datasets.Dataset`` in ``folder``, or None when there is none."""
    if folder is None or not (folder / "dataset_info.json").is_file():
        return None
    import datasets

    return datasets.load_from_disk(str(folder))


def save_atomically(tokenized, folder: Path) -> None:
    """save_to_disk into a temporary folder renamed into place (readers never see half a cache);
    a failure only logs a warning."""
    try:
        with atomic_dir(folder) as tmp:
            tokenized.save_to_disk(tmp)
    except OSError:  # an unwritable cache only costs speed
        logger.warning("could not write the tokenization cache %s", folder)
