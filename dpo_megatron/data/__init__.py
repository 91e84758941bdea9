"""Preference data: raw rows -> ``PreferencePair`` -> padded micro-batches, and who reads which pairs.

Read in this order: ``config`` (DataConfig), ``reader`` (rows from files / hub), ``formats``
(rows -> Example), ``tokenizer`` (HF or SentencePiece, chat templates), ``encode`` (Example ->
token ids), ``lengths`` (max_length rules), ``pipeline`` (all of it, cached, with the summary),
``collate`` (pairs -> tensors), ``sampler`` (pairs per rank and step).

The names below are imported on first use: the launcher's config check imports
``data.config`` and must not pay for torch, numpy or ``datasets``.
"""

from importlib import import_module

_EXPORTS = {
    "DataConfig": "config",
    "DataError": "reader",
    "PairSampler": "sampler",
    "PreferenceDataset": "pairs",
    "PreferencePair": "pairs",
    "SFTDataset": "pairs",
    "SFTExample": "pairs",
    "SentencePieceTokenizer": "tokenizer",
    "UnpairedDataset": "pairs",
    "UnpairedExample": "pairs",
    "UnpairedPair": "pairs",
    "collate_pairs": "collate",
    "collate_rows": "collate",
    "collate_sft": "collate",
    "load_preference_pairs": "pipeline",
    "load_sft_examples": "pipeline",
    "load_unpaired_examples": "pipeline",
    "load_tokenizer": "tokenizer",
    "padded_length": "collate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
