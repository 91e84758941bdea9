"""The data path: raw rows -> typed items of the loss's kind -> micro-batches, and who reads which.

Read in this order: ``config`` (DataConfig), ``kinds`` (the item kind a loss trains on: pairs,
SFT examples, unpaired examples), then the stages ``pipeline`` runs per source: ``read`` (rows
from files / hub via ``sources``, the format from the registry of ``format_registry`` /
``formats``), ``tokenization`` (Example -> token ids via ``tokenizer`` and ``encode``, cached by
``cache``), ``selection`` (caps, duplicates, ``lengths``, eval split, mix: the typed items of
``pairs``), ``summary``; then the batches: ``batch`` (the contract), ``builders`` (the run's
builder: ``collate``, ``packing``, ``context_split``) and ``sampler`` (items per rank and step).

The names below are imported on first use: the launcher's config check imports
``data.config`` and must not pay for torch, numpy or ``datasets``.
"""

from importlib import import_module

_EXPORTS = {
    "DataConfig": "config",
    "DataError": "sources",
    "ItemKind": "kinds",
    "ItemSampler": "sampler",
    "PreferenceDataset": "pairs",
    "PreferencePair": "pairs",
    "SFTDataset": "pairs",
    "SFTExample": "pairs",
    "SentencePieceTokenizer": "tokenizer",
    "UnpairedDataset": "pairs",
    "UnpairedExample": "pairs",
    "UnpairedPair": "pairs",
    "check_sources": "pipeline",
    "collate_pairs": "collate",
    "collate_rows": "collate",
    "collate_sft": "collate",
    "item_kind": "kinds",
    "load_items": "pipeline",
    "load_preference_pairs": "pipeline",
    "load_sft_examples": "pipeline",
    "load_unpaired_examples": "pipeline",
    "load_tokenizer": "tokenizer",
    "make_batch_builder": "builders",
    "padded_length": "collate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
