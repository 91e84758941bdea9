"""Unpaired (KTO) rows: formats, detection, errors, the KL completions and the label counts."""

import pytest

from dpo_megatron.data import DataConfig, DataError, load_preference_pairs
from dpo_megatron.data.formats import FORMATS, RowError, detect_format
from dpo_megatron.data.kinds import UNPAIRED_KIND
from dpo_megatron.data.pairs import UnpairedExample, UnpairedPair
from dpo_megatron.data.pipeline import check_sources, load_unpaired_examples
from dpo_megatron.data.summary import format_summary
from dpo_megatron.data.unpaired import label_counts, with_kl_completions
from tests.data.fixtures import tiny_hf_tokenizer, write_json, write_jsonl

CFG = DataConfig()
KTO_ROW = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "Blue."},
    ],
    "label": True,
}


def test_kto_messages_rows_split_at_the_last_assistant_message():
    (example,) = FORMATS["kto_messages"].convert(KTO_ROW, CFG)
    assert example.prompt == KTO_ROW["messages"][:3] and example.chosen == KTO_ROW["messages"][3:]
    assert example.rejected is None and example.label is True


def test_trl_unpaired_rows_standard_and_conversational():
    (text,) = FORMATS["unpaired"].convert(
        {"prompt": "The sky is", "completion": " blue.", "label": False}, CFG
    )
    assert (text.prompt, text.chosen, text.rejected, text.label) == (
        "The sky is",
        " blue.",
        None,
        False,
    )
    row = {
        "prompt": [{"role": "user", "content": "Sky?"}],
        "completion": [{"role": "assistant", "content": "Blue"}],
        "label": True,
    }
    (chat,) = FORMATS["unpaired_conversational"].convert(row, CFG)
    assert chat.conversational and chat.label is True


@pytest.mark.parametrize(
    "fmt, row, field",
    [
        ("kto_messages", {**KTO_ROW, "label": "yes"}, "label"),
        ("kto_messages", {**KTO_ROW, "label": 1}, "label"),
        ("kto_messages", {"messages": KTO_ROW["messages"][:3], "label": True}, "messages"),
        ("kto_messages", {"messages": KTO_ROW["messages"][3:], "label": True}, "messages"),
        ("unpaired", {"prompt": "a", "completion": "b"}, "label"),
        (
            "unpaired_conversational",
            {
                "prompt": [{"role": "user", "content": "a"}],
                "completion": [{"role": "user", "content": "b"}],
                "label": True,
            },
            "completion[0].role",
        ),
    ],
)
def test_malformed_unpaired_rows_name_the_field(fmt, row, field):
    with pytest.raises(RowError) as err:
        FORMATS[fmt].convert(row, CFG)
    assert err.value.field == field


def test_detection():
    assert detect_format(["messages", "label"], KTO_ROW) == "kto_messages"
    assert detect_format(["prompt", "completion", "label"], {"completion": "x"}) == "unpaired"
    assert (
        detect_format(["prompt", "completion", "label"], {"completion": [{}]})
        == "unpaired_conversational"
    )


def test_kl_completions_are_the_previous_examples_cut_to_the_room_left():
    examples = [
        UnpairedExample((1, 2), (10, 11, 12), True),
        UnpairedExample((3,), (20,), False),
        UnpairedExample((4, 5, 6, 7), (30, 31), True),
    ]
    pairs = with_kl_completions(examples, max_length=6)
    assert [p.rejected_ids for p in pairs] == [(30, 31), (10, 11, 12), (20,)]
    assert [p.desirable for p in pairs] == [True, False, True]
    assert [p.chosen_ids for p in pairs] == [(10, 11, 12), (20,), (30, 31)]
    assert with_kl_completions(examples, max_length=5)[0].rejected_ids == (30, 31)
    assert with_kl_completions(examples[2:], max_length=5)[0].rejected_ids == (30,)  # room 5 - 4
    assert isinstance(pairs[0], UnpairedPair) and label_counts(pairs) == {
        "desirable": 2,
        "undesirable": 1,
    }


def test_load_counts_labels_and_drops_like_pairs(tmp_path):
    tok = tiny_hf_tokenizer()
    rows = [
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        {"prompt": "The sky is", "completion": "  ", "label": False},  # empty completion
        {"prompt": "Grass is", "completion": " green.", "label": False},
        {"prompt": "Snow is", "completion": " white.", "label": True},
    ]
    path = write_jsonl(tmp_path / "u.jsonl", rows)
    ds = load_unpaired_examples(DataConfig(path=str(path), cache_dir="none", verbose=False), tok)
    assert ds.summary.dropped == {"empty_completion": 1} and ds.summary.unit == "examples"
    assert ds.summary.labels == {"desirable": 2, "undesirable": 1}
    assert [p.desirable for p in ds.train] == [True, False, True]
    completions = [p.chosen_ids for p in ds.train]
    assert [p.rejected_ids for p in ds.train] == completions[-1:] + completions[:-1]
    assert ds.train[1].chosen_ids == tuple(tok.encode(" green.")) + (tok.eos_token_id,)
    text = format_summary(ds.summary)  # one completion per example: no chosen / rejected
    assert ", completion 0\n" in text and "rejected" not in text and "chosen" not in text
    assert "  lengths completion tokens: " in text and "  lengths sequence tokens: " in text


def test_paired_and_unpaired_data_meet_the_wrong_loss_with_one_line(tmp_path):
    tok = tiny_hf_tokenizer()
    unpaired = write_json(tmp_path / "kto.json", [KTO_ROW])
    with pytest.raises(DataError, match="loss.name=kto"):
        load_preference_pairs(DataConfig(path=str(unpaired), cache_dir="none", verbose=False), tok)
    with pytest.raises(DataError, match="loss.name=kto"):
        check_sources(DataConfig(path=str(unpaired)))
    paired = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match="holds pairs; an unpaired loss"):
        load_unpaired_examples(DataConfig(path=str(paired), cache_dir="none", verbose=False), tok)
    assert check_sources(DataConfig(path=str(unpaired)), UNPAIRED_KIND)[0][1] == "kto_messages"
