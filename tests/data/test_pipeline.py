"""load_preference_pairs: drops counted by reason, bad input named, lengths, split, mix, cache."""

import json

import pytest

from dpo_megatron.data import DataConfig, DataError, load_preference_pairs
from dpo_megatron.data.pairs import DataSummary, LengthStats, SourceSummary
from dpo_megatron.data.summary import format_summary, length_stats
from tests.data.fixtures import tiny_hf_tokenizer, write_jsonl

GOOD = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}


def _cfg(path, **kw):
    kw.setdefault("cache_dir", "none")
    kw.setdefault("verbose", False)
    return DataConfig(path=str(path), **kw)


def test_drops_counted_by_reason(tmp_path, capsys):
    tok = tiny_hf_tokenizer()
    rows = [
        GOOD,
        {"prompt": "The sky is", "chosen": "   ", "rejected": " green."},  # empty completion
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " blue."},  # chosen == rejected
        {
            "prompt": "The sky is blue. " * 20,
            "chosen": " yes",
            "rejected": " no",
        },  # prompt > max_length
        {"prompt": "Hello!", "chosen": " yes", "rejected": " no"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_preference_pairs(_cfg(path, max_length=16, max_prompt_length=0, verbose=True), tok)
    s = ds.summary
    assert (s.rows_read, s.kept, len(ds.train)) == (5, 2, 2)
    assert s.dropped == {"empty_completion": 1, "identical": 1, "prompt_too_long": 1}
    assert [p.prompt_ids for p in ds.train] == [
        tuple(tok.encode("The sky is")),
        tuple(tok.encode("Hello!")),
    ]
    out = capsys.readouterr().out
    assert "data: 5 rows read, 2 pairs kept (2 train, 0 eval)" in out
    assert "dropped by reason: empty_completion 1, identical 1, prompt_too_long 1" in out
    # the source's line says where each reason's first row is
    assert (
        f"{path} (standard): 5 rows, 2 kept, dropped: empty_completion 1 (first: line 2), "
        "identical 1 (first: line 3), prompt_too_long 1 (first: line 4)\n"
    ) in out
    # More than DROP_WARNING_SHARE (10%) lost: one warning line, each reason with its key.
    assert out.splitlines()[-1] == (
        "WARNING: 3 of 5 pairs (60%) were dropped: empty_completion 1; identical 1; "
        "prompt_too_long 1 (the prompt leaves no room for a completion in data.max_length: "
        "raise data.max_length, or set data.max_prompt_length (> 0) to cut long prompts "
        "instead of dropping their pairs)"
    )


def test_no_drop_warning_at_or_below_a_tenth(tmp_path, capsys):
    """1 of 10 pairs dropped (10%): the counts say it, no warning; 2 of 10 warn."""
    from dpo_megatron.data.summary import DROP_WARNING_SHARE

    assert DROP_WARNING_SHARE == 0.10
    long = {"prompt": "The sky is blue. " * 20, "chosen": " yes", "rejected": " no"}
    for n_long, warned in ((1, False), (2, True)):
        rows = [
            {"prompt": f"Hello {i}!", "chosen": " yes", "rejected": " no"}
            for i in range(10 - n_long)
        ] + [long] * n_long
        path = write_jsonl(tmp_path / f"d{n_long}.jsonl", rows)
        load_preference_pairs(
            _cfg(path, max_length=16, max_prompt_length=0, verbose=True), tiny_hf_tokenizer()
        )
        out = capsys.readouterr().out
        assert ("WARNING:" in out) == warned, out
        assert (
            f"WARNING: {n_long} of 10 pairs (20%) were dropped: prompt_too_long {n_long} " in out
        ) == warned


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps(GOOD)
        + "\n"
        + json.dumps(GOOD)
        + "\n"
        + '{"prompt": "x", "chosen": \n'
        + json.dumps(GOOD)
        + "\n"
    )
    with pytest.raises(DataError) as error:
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())
    # one location: the file's line, then the column in it (not json's own "line 1 column 27")
    assert str(error.value) == f"{path}: line 3: column 27: malformed JSON: Expecting value"
    ds = load_preference_pairs(_cfg(path, on_error="skip"), tiny_hf_tokenizer())
    assert (ds.summary.rows_read, ds.summary.kept, ds.summary.dropped) == (
        4,
        3,
        {"malformed": 1},
    )


def test_malformed_json_array(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"prompt": "a"},\n {"prompt": oops}\n]')
    with pytest.raises(DataError, match=r"bad.json: line 3 column 13: malformed JSON"):
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())


def test_bad_field_names_file_row_and_field(tmp_path):
    path = write_jsonl(
        tmp_path / "f.jsonl", [GOOD, GOOD | {"rejected": 7}, GOOD | {"chosen": None}]
    )
    with pytest.raises(
        DataError,
        match=r"f.jsonl: line 2: field 'rejected': expected a string, got int \(and 1 more",
    ):
        load_preference_pairs(_cfg(path, format="standard"), tiny_hf_tokenizer())
    ds = load_preference_pairs(_cfg(path, format="standard", on_error="skip"), tiny_hf_tokenizer())
    assert (ds.summary.kept, ds.summary.dropped) == (1, {"malformed": 2})


def test_length_rules_by_hand(tmp_path):
    tok = tiny_hf_tokenizer()
    prompt, chosen, rejected = (
        "The sky is blue. The grass is green.",
        " It is blue, it is green.",
        " no",
    )
    path = write_jsonl(
        tmp_path / "l.jsonl", [{"prompt": prompt, "chosen": chosen, "rejected": rejected}]
    )
    P, C, R = tok.encode(prompt), tok.encode(chosen) + [2], tok.encode(rejected) + [2]
    assert len(P) > 4 and len(C) > 4
    for mode, kept in (("keep_end", P[-4:]), ("keep_start", P[:4])):
        pair = load_preference_pairs(
            _cfg(path, max_length=8, max_prompt_length=4, truncation_mode=mode), tok
        ).train[0]
        assert list(pair.prompt_ids) == kept
        assert list(pair.chosen_ids) == C[:4]  # cut: no EOS at the end
        assert list(pair.rejected_ids) == R  # fits: keeps its EOS
    ds = load_preference_pairs(_cfg(path, max_length=8, max_prompt_length=4), tok)
    assert ds.summary.truncated == {
        "prompt": 1,
        "prompt_turns_dropped": 0,
        "prompt_tokens_cut": 1,
        "chosen": 1,
        "rejected": 0,
    }


def test_config_errors():
    with pytest.raises(ValueError, match="data.truncation_mode='middle'"):
        DataConfig(path="x", truncation_mode="middle").validate()
    with pytest.raises(ValueError, match="data.max_prompt_length=512 leaves fewer than"):
        DataConfig(path="x", max_length=512, max_prompt_length=512).validate()
    with pytest.raises(ValueError, match="data.weights has 1 entries for 2 datasets"):
        DataConfig(datasets=["a", "b"], weights=[1.0]).validate()
    with pytest.raises(ValueError, match="no data"):
        DataConfig().validate()
    with pytest.raises(FileNotFoundError, match="data file ./nope.jsonl does not exist"):
        load_preference_pairs(DataConfig(path="./nope.jsonl"), tiny_hf_tokenizer())


def test_eval_split_deterministic(tmp_path):
    rows = [{"prompt": f"Question {i}?", "chosen": " yes", "rejected": " no"} for i in range(10)]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    tok = tiny_hf_tokenizer()
    a = load_preference_pairs(_cfg(path, eval_fraction=0.2), tok)
    b = load_preference_pairs(_cfg(path, eval_fraction=0.2), tok)
    c = load_preference_pairs(_cfg(path, eval_fraction=0.2, seed=99), tok)
    assert (len(a.train), len(a.eval)) == (8, 2)
    assert (a.train, a.eval) == (b.train, b.eval)
    assert set(a.train) | set(a.eval) == set(c.train) | set(c.eval)
    assert set(a.eval) != set(c.eval)


def test_mixing_with_weights(tmp_path):
    tok = tiny_hf_tokenizer()
    a = write_jsonl(
        tmp_path / "a.jsonl",
        [{"prompt": f"A{i}", "chosen": " yes", "rejected": " no"} for i in range(4)],
    )
    b = write_jsonl(
        tmp_path / "b.jsonl",
        [{"chosen": f"B{i} is blue.", "rejected": f"B{i} is green."} for i in range(2)],
    )
    cfg = DataConfig(datasets=[str(a), str(b)], weights=[1.0, 1.0], cache_dir="none", verbose=False)
    ds = load_preference_pairs(cfg, tok)
    assert [s.format for s in ds.summary.sources] == ["standard", "implicit"]
    from_a = [p for p in ds.train if tok.decode(p.prompt_ids).startswith("A")]
    from_b = [p for p in ds.train if tok.decode(p.prompt_ids).startswith("B")]
    assert (len(from_a), len(from_b), len(set(from_a))) == (
        3,
        3,
        3,
    )  # 6 pairs, half each; B repeated
    assert set(from_b) == set(load_preference_pairs(_cfg(b), tok).train)
    unweighted = load_preference_pairs(
        DataConfig(datasets=[str(a), str(b)], cache_dir="none", verbose=False), tok
    )
    assert len(unweighted.train) == 6 and len(set(unweighted.train)) == 6


def test_tokenization_cache_hit_and_invalidation(tmp_path, monkeypatch):
    from dpo_megatron.data import tokenization

    tok = tiny_hf_tokenizer()
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD])
    cache = tmp_path / "cache"
    first = load_preference_pairs(_cfg(path, cache_dir=str(cache)), tok)
    assert len(list(cache.glob("tokenized-*"))) == 1

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokenization, "_tokenize_batch", boom)
    again = load_preference_pairs(
        _cfg(path, cache_dir=str(cache), eval_fraction=0.0, shuffle=False), tok
    )  # not in the key
    assert again.train == first.train
    # The length limits are in the key: the encoder drops whole turns and bounds huge texts by them.
    with pytest.raises(AssertionError, match="tokenized again"):
        load_preference_pairs(
            _cfg(path, cache_dir=str(cache), max_length=64, max_prompt_length=32), tok
        )
    write_jsonl(path, [GOOD, GOOD | {"prompt": "Hello!"}])  # new data: new key
    with pytest.raises(AssertionError, match="tokenized again"):
        load_preference_pairs(_cfg(path, cache_dir=str(cache)), tok)


def test_num_proc_matches_single_process(tmp_path):
    rows = [
        {
            "prompt": f"Question {i}: is the sky blue?",
            "chosen": " It is blue.",
            "rejected": f" No {i}.",
        }
        for i in range(130)
    ]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    tok = tiny_hf_tokenizer()
    one = load_preference_pairs(_cfg(path), tok)
    two = load_preference_pairs(_cfg(path, num_proc=2), tok)
    assert one.train == two.train and len(one.train) == 130


def test_length_stats_and_format():
    assert length_stats([1, 2, 3, 4]) == LengthStats(p50=2, p90=4, p99=4, max=4)
    assert length_stats([]) == LengthStats(0, 0, 0, 0)
    summary = DataSummary(
        unit="pairs",
        rows_read=3,
        kept=2,
        train=2,
        eval=0,
        max_length=8,
        max_prompt_length=4,
        dropped={"identical": 1},
        truncated={
            "prompt": 0,
            "prompt_turns_dropped": 0,
            "prompt_tokens_cut": 0,
            "chosen": 0,
            "rejected": 0,
        },
        lengths_before_cut={"prompt": length_stats([3])},
        lengths={"prompt": length_stats([3])},
        sources=[
            SourceSummary("f", "standard", 3, 2, {"identical": 1}, "train"),
            SourceSummary("g", "standard", 9, 6, {"identical": 2, "x": 1}, "train", {"x": "l 4"}),
        ],
    )
    text = format_summary(summary)
    assert "f (standard): 3 rows, 2 kept, dropped: identical 1\n" in text
    # where the first row of a reason was dropped, when the selection said
    assert "g (standard): 9 rows, 6 kept, dropped: identical 2, x 1 (first: l 4)\n" in text
    assert "lengths prompt tokens: p50 3 p90 3 p99 3 max 3" in text
    # Plain JSON-ready values for logs and files.
    assert summary.to_dict()["lengths"] == {"prompt": {"p50": 3, "p90": 3, "p99": 3, "max": 3}}


def test_arrow_parquet_saved_folder_and_hub_passthrough(tmp_path, monkeypatch):
    import datasets

    tok = tiny_hf_tokenizer()
    ds = datasets.Dataset.from_list([GOOD])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    expected = load_preference_pairs(_cfg(write_jsonl(tmp_path / "d.jsonl", [GOOD])), tok).train
    for path in (tmp_path / "d.parquet", arrow, tmp_path / "saved"):
        assert load_preference_pairs(_cfg(path), tok).train == expected, path
    calls = []

    def fake_load_dataset(name, split=None, **kw):
        calls.append((name, split))
        return ds

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_preference_pairs(_cfg("someone/prefs", split="train_prefs"), tok).train == expected
    assert calls == [("someone/prefs", "train_prefs")]


def test_config_from_omegaconf_and_dict(tmp_path):
    from omegaconf import OmegaConf

    path = write_jsonl(tmp_path / "o.jsonl", [GOOD])
    tok = tiny_hf_tokenizer()
    expected = load_preference_pairs(_cfg(path), tok).train
    structured = OmegaConf.merge(
        OmegaConf.structured(DataConfig), {"path": str(path), "cache_dir": "none", "verbose": False}
    )
    assert load_preference_pairs(structured, tok).train == expected
    assert (
        load_preference_pairs({"path": str(path), "cache_dir": "none", "verbose": False}, tok).train
        == expected
    )
    with pytest.raises(ValueError, match=r"unknown data config key\(s\) \['max_lenght'\]"):
        load_preference_pairs({"path": str(path), "max_lenght": 3}, tok)


def test_unknown_format_fails_before_reading():
    with pytest.raises(
        ValueError, match="data.format='sharegtp'; known formats: auto, alpaca, conversational"
    ):
        load_preference_pairs(
            DataConfig(path="/nonexistent.jsonl", format="sharegtp"), tiny_hf_tokenizer()
        )


def test_eval_datasets_read_their_test_split(tmp_path, capsys):
    """A folder with train.jsonl and test.jsonl named in data.datasets and data.eval_datasets:
    the train split trains, the test split's kept pairs (2 of 3: one is identical) evaluate,
    through the same conversion and checks; eval_fraction alongside is refused."""
    tok = tiny_hf_tokenizer()
    folder = tmp_path / "hh"
    folder.mkdir()
    write_jsonl(
        folder / "train.jsonl", [GOOD, GOOD | {"prompt": "Hello!"}, GOOD | {"prompt": "Yes"}]
    )
    write_jsonl(
        folder / "test.jsonl",
        [
            GOOD | {"chosen": " yes"},
            GOOD | {"rejected": " blue."},
            GOOD | {"prompt": "Hello!", "rejected": " no"},
        ],
    )
    cache = tmp_path / "cache"
    cfg = DataConfig(
        datasets=[str(folder)], eval_datasets=[str(folder)], cache_dir=str(cache), verbose=True
    )
    ds = load_preference_pairs(cfg, tok)
    assert len(list(cache.glob("tokenized-*"))) == 2  # the train and the test split, cached
    again = load_preference_pairs(cfg, tok)
    assert (again.train, again.eval) == (ds.train, ds.eval)
    assert [p.prompt_ids for p in ds.train] == [
        tuple(tok.encode(t)) for t in ("The sky is", "Hello!", "Yes")
    ]
    assert [(p.prompt_ids, p.chosen_ids[:-1], p.rejected_ids[:-1]) for p in ds.eval] == [
        (tuple(tok.encode("The sky is")), tuple(tok.encode(" yes")), tuple(tok.encode(" green."))),
        (tuple(tok.encode("Hello!")), tuple(tok.encode(" blue.")), tuple(tok.encode(" no"))),
    ]
    assert (ds.summary.train, ds.summary.eval, ds.summary.dropped) == (
        3,
        2,
        {"identical": 1},
    )
    out = capsys.readouterr().out
    assert f"{folder}[train] (standard): 3 rows, 3 kept" in out
    assert f"eval set {folder}[test] (standard): 3 rows, 2 kept, dropped: identical 1" in out
    with pytest.raises(
        ValueError, match="data.eval_datasets and data.eval_fraction=0.1 are both set"
    ):
        load_preference_pairs(
            DataConfig(datasets=[str(folder)], eval_datasets=[str(folder)], eval_fraction=0.1), tok
        )


def test_eval_datasets_errors_name_file_line_and_field(tmp_path):
    """The launchers' pre-check (check_sources) and the load read the eval files too: a bad row
    of test.jsonl is named by its file and line; a missing split is named with the ones there."""
    from dpo_megatron.data.pipeline import check_sources

    folder = tmp_path / "d"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [GOOD])
    write_jsonl(folder / "test.jsonl", [GOOD, GOOD | {"chosen": 3}])
    cfg = DataConfig(path=str(folder), eval_datasets=[str(folder)], on_error="raise")
    with pytest.raises(
        DataError, match=r"d\[test\]: test.jsonl line 2: field 'chosen': expected a string"
    ):
        check_sources(cfg)
    with pytest.raises(DataError, match=r"test.jsonl line 2: field 'chosen'"):
        load_preference_pairs(_cfg(folder, eval_datasets=[str(folder)]), tiny_hf_tokenizer())
    assert check_sources(
        DataConfig(path=str(folder), eval_datasets=[str(folder / "train.jsonl")])
    ) == [(f"{folder}[train]", "standard"), (str(folder / "train.jsonl"), "standard")]
    with pytest.raises(
        DataError, match=r"no split 'validation'; its files make the split\(s\) \['test', 'train'\]"
    ):
        check_sources(
            DataConfig(path=str(folder), eval_datasets=[str(folder)], eval_split="validation")
        )
