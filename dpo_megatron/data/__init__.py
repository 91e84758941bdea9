"""Preference data: raw rows -> ``PreferencePair`` -> padded micro-batches, and who reads which pairs.

Read in this order: ``config`` (DataConfig), ``reader`` (rows from files / hub), ``formats``
(rows -> Example), ``tokenizer`` (HF or SentencePiece, chat templates), ``encode`` (Example ->
token ids), ``lengths`` (max_length rules), ``pipeline`` (all of it, cached, with the summary),
``collate`` (pairs -> tensors), ``sampler`` (pairs per rank and step).
"""

from .collate import collate_pairs, collate_rows, collate_sft, padded_length
from .config import DataConfig
from .pairs import PreferenceDataset, PreferencePair, SFTDataset, SFTExample
from .pipeline import load_preference_pairs, load_sft_examples
from .reader import DataError
from .sampler import PairSampler
from .tokenizer import SentencePieceTokenizer, load_tokenizer

__all__ = [
    "DataConfig",
    "DataError",
    "PairSampler",
    "PreferenceDataset",
    "PreferencePair",
    "SFTDataset",
    "SFTExample",
    "SentencePieceTokenizer",
    "collate_pairs",
    "collate_rows",
    "collate_sft",
    "load_preference_pairs",
    "load_sft_examples",
    "load_tokenizer",
    "padded_length",
]
