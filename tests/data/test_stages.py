"""The data path by stage: the format registry (a format is one entry), the item kind chosen once
(its formats, its items, its builder, its unit), the typed stage results. (No import circle in
``dpo_megatron.data``: tests/test_layering.py checks the whole package.)"""

import pytest

from dpo_megatron.data import DataConfig, DataError, load_preference_pairs, load_sft_examples
from dpo_megatron.data.builders import make_batch_builder
from dpo_megatron.data.collate import PaddedPairs, SFTExamples
from dpo_megatron.data.config import PackingConfig
from dpo_megatron.data.encode import encode_settings
from dpo_megatron.data.formats import (
    FORMATS,
    Example,
    RowError,
    RowFormat,
    detect_format,
    register_format,
)
from dpo_megatron.data.kinds import PAIRS_KIND, SFT_KIND, UNPAIRED_KIND, item_kind
from dpo_megatron.data.pairs import PreferencePair, SFTExample, UnpairedExample, UnpairedPair
from dpo_megatron.data.pipeline import check_sources
from dpo_megatron.data.read import read
from dpo_megatron.data.selection import SelectedSource, select_source
from dpo_megatron.data.tokenization import TokenizedRow, tokenize_source
from tests.data.fixtures import tiny_hf_tokenizer, write_jsonl

ROWS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Hello!", "chosen": " yes", "rejected": " no"},
]


def _cfg(path, **kw):
    kw.setdefault("cache_dir", "none")
    kw.setdefault("verbose", False)
    return DataConfig(path=str(path), **kw)


def _convert_qa(row, cfg):
    if not isinstance(row.get("q"), str):
        raise RowError("q", "expected a string")
    return [Example(row["q"], row["good"], row["bad"])]


def test_a_new_format_is_one_registry_entry(tmp_path):
    """A format registered once is detected from its columns, accepted by the config check and
    the pre-check, and loads the pairs the equivalent standard rows load."""
    tok = tiny_hf_tokenizer()
    register_format(RowFormat("qa_test", _convert_qa, {"q", "good", "bad"}))
    try:
        qa = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in ROWS]
        qa_path = write_jsonl(tmp_path / "qa.jsonl", qa)
        std_path = write_jsonl(tmp_path / "std.jsonl", ROWS)
        assert detect_format(["q", "good", "bad", "id"], qa[0]) == "qa_test"
        DataConfig(path=str(qa_path), format="qa_test").validate()
        assert check_sources(_cfg(qa_path)) == [(str(qa_path), "qa_test")]
        loaded = load_preference_pairs(_cfg(qa_path), tok)
        assert loaded.train == load_preference_pairs(_cfg(std_path), tok).train
        assert len(loaded.train) == 2 and loaded.summary.sources[0].format == "qa_test"
        with pytest.raises(ValueError, match="registered twice"):
            register_format(RowFormat("qa_test", _convert_qa, {"q"}))
    finally:
        del FORMATS["qa_test"]
    with pytest.raises(ValueError, match="known formats: auto, alpaca"):
        DataConfig(path=str(qa_path), format="qa_test").validate()


def test_registry_holds_what_each_format_reads():
    assert [f.name for f in FORMATS.values() if not f.has_rejected] == [
        "alpaca",
        "kto_messages",
        "unpaired_conversational",
        "unpaired",
    ]
    # formats sharing columns are told apart by their first row
    assert detect_format(["prompt", "chosen", "rejected"], {"chosen": "a"}) == "standard"
    assert detect_format(["chosen", "rejected"], {"chosen": "\n\nHuman: hi"}) == "hh"
    assert detect_format(["chosen", "rejected"], {"chosen": [{}]}) == "conversational_implicit"
    with pytest.raises(ValueError, match="cannot tell the data format"):
        detect_format(["prompt", "chosen", "rejected"], {"chosen": 3})


def test_item_kind_is_chosen_once_and_carries_its_parts():
    assert item_kind("pairs") is PAIRS_KIND and item_kind(SFT_KIND) is SFT_KIND
    with pytest.raises(ValueError, match="unknown item kind"):
        item_kind("triples")
    assert (PAIRS_KIND.item_class, SFT_KIND.item_class, UNPAIRED_KIND.item_class) == (
        PreferencePair,
        SFTExample,
        UnpairedPair,
    )
    assert (PAIRS_KIND.unit, SFT_KIND.unit, UNPAIRED_KIND.unit) == ("pairs", "examples", "examples")
    SFT_KIND.check_format(FORMATS["alpaca"], "a.json")
    with pytest.raises(DataError, match=r"a.json: format 'alpaca' has no rejected answers"):
        PAIRS_KIND.check_format(FORMATS["alpaca"], "a.json")
    with pytest.raises(DataError, match="holds pairs; an unpaired loss"):
        UNPAIRED_KIND.check_format(FORMATS["standard"], "s.json")
    with pytest.raises(DataError, match="holds unpaired rows"):
        SFT_KIND.check_format(FORMATS["unpaired"], "u.json")
    # the builder of its micro-batches
    assert type(make_batch_builder(None, pad_token_id=0, multiple=8, kind=SFT_KIND)) is SFTExamples
    assert (
        type(make_batch_builder(None, pad_token_id=0, multiple=8, kind=UNPAIRED_KIND))
        is PaddedPairs
    )
    with pytest.raises(ValueError, match="packs preference pairs"):
        make_batch_builder(PackingConfig(enabled=True), pad_token_id=0, multiple=8, kind=SFT_KIND)
    # its items: the completion a sample is shown against, one name for every kind
    pair = PAIRS_KIND.make_item((1,), (2,), (3,), None)
    example = SFT_KIND.make_item((1,), (2,), None, None)
    unpaired = UNPAIRED_KIND.make_item((1,), (2,), None, False)
    assert (pair, example, unpaired) == (
        PreferencePair((1,), (2,), (3,)),
        SFTExample((1,), (2,)),
        UnpairedExample((1,), (2,), False),
    )
    assert [x.target_ids for x in (pair, example, unpaired)] == [(2,), (2,), (2,)]
    (finished,) = UNPAIRED_KIND.finish([unpaired], 0)
    assert finished.target_ids == (2,) and finished.desirable is False


def test_stages_return_typed_results(tmp_path):
    """read -> tokenize -> select by hand gives the items the load gives, typed at each stage."""
    tok = tiny_hf_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [*ROWS, {"prompt": "x", "chosen": 3}])
    cfg = _cfg(path, on_error="skip")
    source = read(0, str(path), "auto", "train", cfg, SFT_KIND, "train")
    assert source.format.name == "standard" and source.label == str(path)
    tokenized = tokenize_source(source, tok, encode_settings(tok, None), cfg, SFT_KIND)
    assert all(isinstance(row, TokenizedRow) for row in tokenized.rows)
    assert [row.drop for row in tokenized.rows] == ["", "", "malformed"]
    assert tokenized.rows[0].rejected_ids == []  # SFT reads no rejected side
    assert tokenized.rows[0].prompt_ids == tok.encode("The sky is")
    selected = select_source(tokenized, cfg, SFT_KIND, None)
    assert isinstance(selected, SelectedSource)
    assert (selected.rows_read, dict(selected.dropped)) == (3, {"malformed": 1})
    assert selected.kept == load_sft_examples(cfg, tok).train
    assert all(type(x) is SFTExample for x in selected.kept)


def test_a_sliced_split_keeps_its_rows_and_its_own_cache(tmp_path):
    """``data.split=train[1:3]`` keeps rows 1 and 2 of a file (datasets' notation), under its
    own cache entry (a cached full read is not reused), with the original line numbers in
    messages; a malformed range is refused at config time naming the key."""
    rows = [
        {"prompt": f"Question {i}?", "chosen": f" yes {i}", "rejected": " no"} for i in range(5)
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = tiny_hf_tokenizer()
    cache = str(tmp_path / "cache")
    whole = load_preference_pairs(_cfg(path, cache_dir=cache), tok)
    sliced = load_preference_pairs(_cfg(path, cache_dir=cache, split="train[1:3]"), tok)
    tail = load_preference_pairs(_cfg(path, cache_dir=cache, split="train[3:]"), tok)
    assert len(whole.train) == 5
    assert [p.chosen_ids for p in sliced.train] == [p.chosen_ids for p in whole.train[1:3]]
    assert [p.chosen_ids for p in tail.train] == [p.chosen_ids for p in whole.train[3:]]
    assert sliced.summary.rows_read == 2 and sliced.summary.sources[0].label.endswith("[1:3]")
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:2] + [{"prompt": "p", "chosen": " a"}])
    with pytest.raises(DataError, match="line 3"):  # the file's line, not the slice's row 0
        load_preference_pairs(_cfg(bad, split="train[2:]", format="standard"), tok)
    with pytest.raises(ValueError, match=r"data.split: split 'train\[:10%\]'"):
        _cfg(path, split="train[:10%]").validate()
