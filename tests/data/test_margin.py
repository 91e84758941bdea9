"""A row's ``margin`` column (TRL's reward-trainer margin) rides with its pair into the batch that
a reward model's loss reads; a margin that is not a number is named by file, line and field."""

from __future__ import annotations

import pytest

from dpo_megatron.data import DataConfig, DataError, load_preference_pairs
from dpo_megatron.data.collate import PaddedPairs
from dpo_megatron.data.config import PackingConfig
from dpo_megatron.data.packing import SharedPromptPairs
from tests.data.fixtures import tiny_hf_tokenizer, write_jsonl

ROWS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 1.5},
    {"prompt": "Hello!", "chosen": " yes", "rejected": " no"},
    {"prompt": "Answer:", "chosen": " yes", "rejected": " or no", "margin": 2},
]


def _load(path):
    cfg = DataConfig(path=str(path), cache_dir="none", verbose=False, shuffle=False)
    return load_preference_pairs(cfg, tiny_hf_tokenizer())


def test_margins_reach_the_pairs_and_every_batch_form(tmp_path):
    pairs = _load(write_jsonl(tmp_path / "rows.jsonl", ROWS)).train
    assert [p.margin for p in pairs] == [1.5, None, 2.0]
    packing = PackingConfig(enabled=True)
    for kind in ("pairs", "reward"):
        for builder in (PaddedPairs(2, 8, kind), SharedPromptPairs(2, 8, packing, kind=kind)):
            batch = builder.build(pairs, [[0, 1], [2]])
            margins = [targets.margin.tolist() for targets in batch.targets]
            assert margins == [[1.5, 0.0], [2.0]]
        assert PaddedPairs(2, 8, kind).build(pairs, [[1]]).targets[0].margin is None


def test_a_bad_margin_is_named(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {**ROWS[1], "margin": "high"}])
    with pytest.raises(DataError, match=r"bad.jsonl: line 2.*'margin'"):
        _load(path)
