"""Bad or unusual input reported where it is: non-UTF-8 bytes, JSON
Lines rows that are arrays, a format that does not fit, duplicates, one huge row, text prompts
ending in a space, HH pairs that diverge early, and the launchers' data pre-check."""

import json
import logging

import pytest

from dpo_megatron.data import DataConfig, DataError, load_preference_pairs
from dpo_megatron.data.pipeline import check_sources
from dpo_megatron.data.sources import read_source
from dpo_megatron.data.summary import format_summary
from tests.data.fixtures import tiny_hf_tokenizer, write_json, write_jsonl

GOOD = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
SHAREGPT = {
    "conversations": [{"from": "human", "value": "Is the sky blue?"}],
    "chosen": {"from": "gpt", "value": "It is blue."},
    "rejected": {"from": "gpt", "value": "No."},
}


def _cfg(path, **kw):
    kw.setdefault("cache_dir", "none")
    kw.setdefault("verbose", False)
    return DataConfig(path=str(path), **kw)


def _bad_utf8_jsonl(tmp_path):
    path = tmp_path / "latin1.jsonl"
    lines = [
        json.dumps(GOOD).encode(),
        json.dumps(GOOD | {"prompt": "caf\u00e9 is"}).encode("utf-8"),
        json.dumps(GOOD | {"prompt": "XX"}).encode().replace(b"XX", b"caf\xe9"),
        json.dumps(GOOD).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_non_utf8_byte_names_file_line_and_byte_and_skip_drops_the_row(tmp_path):
    """A byte that is not UTF-8 is named by file, line, byte and file offset (not a bare
    ``UnicodeDecodeError``), and on_error=skip drops and counts its row."""
    path = _bad_utf8_jsonl(tmp_path)
    offset = path.read_bytes().index(b"\xe9")
    line_start = path.read_bytes().rindex(b"\n", 0, offset) + 1
    with pytest.raises(DataError) as e:
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())
    assert (
        f"latin1.jsonl: line 3, byte {offset - line_start + 1} (file offset {offset}): byte 0xe9 "
        "is not UTF-8" in str(e.value)
    )
    ds = load_preference_pairs(_cfg(path, on_error="skip"), tiny_hf_tokenizer())
    assert (ds.summary.rows_read, ds.summary.kept, ds.summary.dropped) == (
        4,
        3,
        {"malformed": 1},
    )


def test_non_utf8_byte_in_a_json_array(tmp_path):
    path = tmp_path / "rows.json"
    text = json.dumps([GOOD, GOOD | {"prompt": "XX"}, GOOD], indent=1).encode()
    path.write_bytes(text.replace(b"XX", b"\xff\xfe"))
    with pytest.raises(
        DataError,
        match=r"rows.json: line \d+, byte \d+ \(file offset \d+\): byte 0xff is not UTF-8",
    ):
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())
    ds = load_preference_pairs(_cfg(path, on_error="skip"), tiny_hf_tokenizer())
    assert (ds.summary.kept, ds.summary.dropped) == (2, {"malformed": 1})


def test_jsonl_rows_that_are_arrays_are_named(tmp_path):
    """JSON Lines rows that are arrays are named by file and line, whether the file starts
    with "[" (not parsed as one JSON array, "Extra data") or is a ``.json`` file."""
    path = tmp_path / "arrays.jsonl"
    path.write_text('["The sky is", " blue.", " green."]\n["a", "b", "c"]\n')
    with pytest.raises(
        DataError, match=r"arrays.jsonl: line 1: expected a JSON object per line, got a JSON list"
    ):
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())
    path = tmp_path / "mixed.json"  # JSON Lines in a .json file
    path.write_text(json.dumps(GOOD) + "\n" + '["a"]\n')
    with pytest.raises(
        DataError, match=r"mixed.json: line 2: expected a JSON object per line, got a JSON list"
    ):
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())


def test_undetectable_format_names_the_file(tmp_path):
    """A file whose format cannot be detected is named in the message, with its columns."""
    path = write_jsonl(tmp_path / "plain.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError, match=r"plain.jsonl from its columns \['text'\]"):
        load_preference_pairs(_cfg(path), tiny_hf_tokenizer())


def test_pinned_format_that_does_not_fit_says_what_the_file_looks_like(tmp_path):
    """A pinned format that no row fits says which format the file looks like, and does not
    suggest data.on_error=skip (which would drop every row); the pre-check says the same."""
    path = write_json(tmp_path / "sg.json", [SHAREGPT, SHAREGPT])
    for on_error in ("raise", "skip"):
        with pytest.raises(DataError) as e:
            load_preference_pairs(
                _cfg(path, format="standard", on_error=on_error), tiny_hf_tokenizer()
            )
        message = str(e.value)
        assert "no row fits data.format='standard'" in message
        assert "look like format 'sharegpt': set data.format=sharegpt" in message
        assert "on_error" not in message
    with pytest.raises(DataError, match="look like format 'sharegpt'"):
        check_sources(_cfg(path, format="hh"))


def test_empty_or_unreadable_parquet_csv_arrow_files_end_in_one_line_naming_the_file(tmp_path):
    """A Parquet, CSV or Arrow file with no rows is refused as a JSON file with none is
    ("<file>: no rows"), and one its loader cannot read names the file and the loader's reason,
    in one DataError line (``datasets`` alone raises a generation error naming neither)."""
    import pandas as pd
    import pyarrow as pa

    empty_parquet = tmp_path / "empty.parquet"
    pd.DataFrame({k: pd.Series([], dtype=str) for k in GOOD}).to_parquet(empty_parquet)
    empty_csv = tmp_path / "empty.csv"
    empty_csv.write_text("")
    header_csv = tmp_path / "header.csv"
    header_csv.write_text("prompt,chosen,rejected\n")
    empty_arrow = tmp_path / "empty.arrow"
    table = pa.table({k: pa.array([], pa.string()) for k in GOOD})
    with pa.OSFile(str(empty_arrow), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table)
    for path in (empty_parquet, empty_csv, header_csv, empty_arrow):
        with pytest.raises(DataError) as e:
            check_sources(_cfg(path))
        assert str(e.value) == f"{path}: no rows"
    junk = tmp_path / "junk.parquet"
    junk.write_text("prompt,chosen,rejected\n")
    with pytest.raises(DataError) as e:
        check_sources(_cfg(junk))
    assert str(e.value).startswith(f"{junk}: not a readable parquet file: ")
    assert "magic bytes" in str(e.value)
    good_csv = tmp_path / "good.csv"
    pd.DataFrame([GOOD, GOOD]).to_csv(good_csv, index=False)
    assert check_sources(_cfg(good_csv)) == [(str(good_csv), "standard")]


def test_a_hub_dataset_that_cannot_be_loaded_ends_in_one_line_naming_it(monkeypatch):
    """A name that is no local path and cannot be loaded from the hub (offline, or misspelt) is
    one DataError line naming it and the hub's reason, which the ranks print alone; the hub is
    put offline here so that the test reads nothing from the network."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as e:
        read_source("someorg/no-such-prefs")
    assert isinstance(e.value, OSError)  # as the hub clients' errors are: offline advice follows
    message = str(e.value)
    assert message.startswith(
        "someorg/no-such-prefs: no such local file or folder, and not loadable as a hub dataset "
        "(online): "
    )
    assert "\n" not in message and "someorg/no-such-prefs' on the Hub" in message


def test_pre_check_finds_missing_files_and_bad_rows_without_a_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        check_sources(_cfg(tmp_path / "nope.jsonl"))
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD | {"rejected": 7}])
    with pytest.raises(DataError, match=r"d.jsonl: line 2: field 'rejected': expected a string"):
        check_sources(_cfg(path))
    assert check_sources(_cfg(path, on_error="skip")) == [(str(path), "standard")]
    assert check_sources(_cfg("org/some-hub-dataset")) == [
        ("org/some-hub-dataset", "auto")
    ]  # not read


def test_duplicates_are_counted_reported_and_optionally_dropped(tmp_path):
    """Duplicate rows are counted and reported with the lines they repeat, kept by default
    and dropped with data.drop_duplicates."""
    other = GOOD | {"prompt": "The grass is"}
    path = write_jsonl(tmp_path / "dup.jsonl", [GOOD, other, GOOD, GOOD])
    ds = load_preference_pairs(_cfg(path), tiny_hf_tokenizer())
    assert len(ds.train) == 4
    assert ds.summary.duplicates.count == 2
    text = format_summary(ds.summary)
    assert "duplicates: 2 pairs repeat an earlier pair's tokens, kept" in text
    assert "line 3 repeats line 1" in text
    ds = load_preference_pairs(_cfg(path, drop_duplicates=True), tiny_hf_tokenizer())
    assert len(ds.train) == 2 and ds.summary.dropped == {"duplicate": 2}


def test_huge_row_is_cut_before_tokenizing(tmp_path, monkeypatch):
    """A 2 MB completion with max_length 64: the tokenizer never sees more than the character
    budget, and the kept tokens equal those of tokenizing the whole text (tokenizing a huge row
    whole before the cut costs memory in proportion to the row)."""
    tok = tiny_hf_tokenizer()
    huge = " It is blue, it is green." * 80_000  # 2 MB
    path = write_jsonl(tmp_path / "huge.jsonl", [GOOD | {"chosen": huge}])
    whole = tok.encode(huge, add_special_tokens=False)
    seen = []
    original = type(tok).encode

    def spy(self, text, *a, **k):
        seen.append(len(text))
        return original(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "encode", spy)
    ds = load_preference_pairs(_cfg(path, max_length=64, max_prompt_length=16), tok)
    pair = ds.train[0]
    assert list(pair.chosen_ids) == whole[: 64 - len(pair.prompt_ids)]
    assert max(seen) < 100_000  # 2 x (64 + 64) x the longest token (13 characters) = 3328 here
    assert ds.summary.notes == {"text_bounded": 1}


def test_text_prompts_ending_in_a_space_warn_once_with_the_count(tmp_path, caplog):
    """Text prompts ending in a space (the space becomes a lone token at the boundary) give one
    warning with their count, as TRL warns, and a note in the summary."""
    rows = [GOOD | {"prompt": "The sky is "}, GOOD | {"prompt": "The grass is "}, GOOD]
    path = write_jsonl(tmp_path / "sp.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="dpo_megatron.data.pipeline"):
        ds = load_preference_pairs(_cfg(path), tiny_hf_tokenizer())
    warnings = [r for r in caplog.records if "end with a space" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].getMessage().startswith(
        "2 text prompt(s) end with a space"
    )
    assert ds.summary.notes == {"prompt_ends_with_space": 2}
    assert "prompt_ends_with_space: 2" in format_summary(ds.summary)


def test_hh_file_with_early_divergence_is_counted(tmp_path):
    """An HH file with an early-diverging pair loads whole: the pair is kept, split at the
    common Assistant turn and counted as ``diverged_early`` (no RowError, no malformed drop)."""
    rows = [
        {
            "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!",
            "rejected": "\n\nHuman: Hi\n\nAssistant: Go.",
        },
        {
            "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Sky?\n\nAssistant: Blue.",
            "rejected": "\n\nHuman: Hi\n\nAssistant: Go.\n\nHuman: Sky?\n\nAssistant: No.",
        },
    ]
    ds = load_preference_pairs(_cfg(write_jsonl(tmp_path / "hh.jsonl", rows)), tiny_hf_tokenizer())
    assert ds.summary.sources[0].format == "hh" and len(ds.train) == 2
    assert ds.summary.notes == {"diverged_early": 1}
    assert "diverged_early: 1" in format_summary(ds.summary)
    tok = tiny_hf_tokenizer()
    chosen_text = tok.decode(ds.train[1].chosen_ids)
    assert (
        chosen_text.startswith("Hello!<|im_end|>")
        and "Sky?" in chosen_text
        and "Blue." in chosen_text
    )
