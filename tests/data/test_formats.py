"""Row converters: each format's rule, detection, and the errors/filters they raise (no
tokenizer)."""

import pytest

from dpo_megatron.data import DataConfig
from dpo_megatron.data.formats import (
    Example,
    Filtered,
    RowError,
    common_text_prefix,
    convert_alpaca,
    convert_conversational,
    convert_conversational_implicit,
    convert_hh,
    convert_implicit,
    convert_se,
    convert_sharegpt,
    convert_shp,
    convert_standard,
    convert_ultrafeedback,
    detect_format,
    strip_html,
)

CFG = DataConfig()
U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731


def test_standard_and_implicit():
    assert convert_standard({"prompt": "Q", "chosen": " a", "rejected": " b"}, CFG) == [
        Example("Q", " a", " b")
    ]
    # the space at the split goes to the completions
    assert convert_implicit(
        {"chosen": "The sky is blue.", "rejected": "The sky is green."}, CFG
    ) == [Example("The sky is", " blue.", " green.")]
    with pytest.raises(Filtered, match="identical"):
        convert_implicit({"chosen": "same", "rejected": "same"}, CFG)
    assert common_text_prefix("ab", "ab") == "ab"
    assert common_text_prefix("xa", "ya") == ""
    with pytest.raises(RowError, match="field 'rejected': expected a string, got int"):
        convert_standard({"prompt": "Q", "chosen": "a", "rejected": 3}, CFG)
    with pytest.raises(RowError, match="field 'prompt': missing"):
        convert_standard({"chosen": "a", "rejected": "b"}, CFG)


def test_conversational_and_implicit_variant():
    row = {"prompt": [S("s"), U("q")], "chosen": [A("a")], "rejected": [A("b")]}
    assert convert_conversational(row, CFG) == [Example([S("s"), U("q")], [A("a")], [A("b")])]
    implicit = {"chosen": [U("q"), A("a")], "rejected": [U("q"), A("b")]}
    assert convert_conversational_implicit(implicit, CFG) == [Example([U("q")], [A("a")], [A("b")])]
    with pytest.raises(
        RowError, match=r"field 'prompt\[1\].role': expected system/user/assistant, got 'bot'"
    ):
        convert_conversational(
            {
                "prompt": [U("q"), {"role": "bot", "content": "x"}],
                "chosen": [A("a")],
                "rejected": [A("b")],
            },
            CFG,
        )
    # a message without its content is named as missing, as a row without a field is
    with pytest.raises(RowError, match=r"^field 'chosen\[0\].content': missing$"):
        convert_conversational(
            {"prompt": [U("q")], "chosen": [{"role": "assistant"}], "rejected": [A("b")]}, CFG
        )
    with pytest.raises(
        RowError, match=r"field 'rejected\[0\].content': expected a string, got int"
    ):
        convert_conversational(
            {
                "prompt": [U("q")],
                "chosen": [A("a")],
                "rejected": [{"role": "assistant", "content": 7}],
            },
            CFG,
        )
    with pytest.raises(RowError, match="the prompt's last message must be from the user"):
        convert_conversational(
            {"prompt": [U("q"), A("x")], "chosen": [A("a")], "rejected": [A("b")]}, CFG
        )
    with pytest.raises(
        RowError, match=r"field 'chosen\[0\].role': a completion message must be from the assistant"
    ):
        convert_conversational({"prompt": [U("q")], "chosen": [U("a")], "rejected": [A("b")]}, CFG)


def test_sharegpt_with_system_turn_and_column():
    row = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
        ],
        "chosen": {"from": "gpt", "value": "good"},
        "rejected": {"from": "gpt", "value": "bad"},
    }
    assert convert_sharegpt(row, CFG) == [
        Example([S("sys"), U("q1"), A("a1"), U("q2")], [A("good")], [A("bad")])
    ]
    row2 = {
        "conversations": [{"from": "human", "value": "q"}],
        "system": "be nice",
        "chosen": "y",
        "rejected": "n",
    }
    assert convert_sharegpt(row2, CFG) == [Example([S("be nice"), U("q")], [A("y")], [A("n")])]
    with pytest.raises(RowError, match=r"field 'conversations\[0\].from': expected one of"):
        convert_sharegpt(
            {"conversations": [{"from": "robot", "value": "q"}], "chosen": "y", "rejected": "n"},
            CFG,
        )
    with pytest.raises(RowError, match="field 'chosen.value': missing"):
        convert_sharegpt(
            {
                "conversations": [{"from": "human", "value": "q"}],
                "chosen": {"from": "gpt"},
                "rejected": "n",
            },
            CFG,
        )


def test_hh():
    row = {
        "chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Is the sky blue?"
        "\n\nAssistant: Yes, it is.",
        "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Is the sky blue?"
        "\n\nAssistant: No.",
    }
    assert convert_hh(row, CFG) == [
        Example([U("Hi there"), A("Hello!"), U("Is the sky blue?")], [A("Yes, it is.")], [A("No.")])
    ]
    with pytest.raises(RowError, match="share no Assistant turn"):  # differ in the first turn
        convert_hh(
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: x\n\nAssistant: b"},
            CFG,
        )


def test_shp_labels_and_score_ratio():
    row = {
        "history": "Why?",
        "human_ref_A": "Because A.",
        "human_ref_B": "Because B.",
        "labels": 0,
        "score_A": 3,
        "score_B": 12,
        "score_ratio": 4.0,
    }
    # grouped by post (for data.shp_max_pairs_per_post): its post_id, else its history
    assert convert_shp(row, CFG) == [
        Example([U("Why?")], [A("Because B.")], [A("Because A.")], group="Why?")
    ]
    assert convert_shp(row | {"post_id": "qt3nxl"}, CFG)[0].group == "qt3nxl"
    assert convert_shp(row | {"labels": 1}, CFG)[0].chosen == [A("Because A.")]
    with pytest.raises(Filtered, match="score_ratio"):
        convert_shp(row | {"score_ratio": 1.5}, CFG)
    no_ratio = {k: v for k, v in row.items() if k != "score_ratio"} | {"score_A": 10, "score_B": 6}
    with pytest.raises(Filtered):  # 10 / 6 < 2
        convert_shp(no_ratio, CFG)


def test_se_pairs_by_score_html_stripped():
    row = {
        "question": "<p>How do I &amp; why?</p>",
        "answers": [
            {"text": "<p>meh</p>", "pm_score": 1},
            {"text": "<p>Use <code>x &lt; y</code>.</p>", "pm_score": 5},
            {"text": "<p>ok</p>", "pm_score": 3},
        ],
    }
    assert convert_se(row, CFG) == [Example([U("How do I & why?")], [A("Use x < y.")], [A("ok")])]
    two = convert_se(row, DataConfig(se_max_pairs_per_question=2))
    assert [e.rejected for e in two] == [[A("ok")], [A("meh")]]
    with pytest.raises(Filtered, match="se_no_pair"):
        convert_se(
            {
                "question": "q",
                "answers": [{"text": "a", "pm_score": 2}, {"text": "b", "pm_score": 2}],
            },
            CFG,
        )
    assert strip_html("<p>a</p><p>b<br>c</p>") == "a\n\nb\nc"


def test_ultrafeedback_and_alpaca():
    row = {
        "prompt": "q",
        "chosen": [U("q"), A("good")],
        "rejected": [U("q"), A("bad")],
        "score_chosen": 8.0,
    }
    assert convert_ultrafeedback(row, CFG) == [Example([U("q")], [A("good")], [A("bad")])]
    with pytest.raises(RowError, match="differ before the last answer"):
        convert_ultrafeedback(row | {"rejected": [U("other"), A("bad")]}, CFG)
    assert convert_ultrafeedback(row | {"prompt": " q\n"}, CFG)[0].notes == ()
    other = row | {"prompt": "another question"}  # not the conversations' user turn
    assert convert_ultrafeedback(other, CFG) == [
        Example([U("q")], [A("good")], [A("bad")], notes=("prompt_differs",))
    ]
    assert convert_alpaca({"instruction": "Add", "input": "1 2", "output": "3"}, CFG) == [
        Example([U("Add\n1 2")], [A("3")], None)
    ]


def test_detect_format():
    assert detect_format(["conversations", "chosen", "rejected"], None) == "sharegpt"
    assert (
        detect_format(["prompt", "chosen", "rejected"], {"chosen": "a", "prompt": "q"})
        == "standard"
    )
    assert (
        detect_format(["prompt", "chosen", "rejected"], {"chosen": [A("a")], "prompt": [U("q")]})
        == "conversational"
    )
    assert (
        detect_format(
            ["prompt", "chosen", "rejected", "messages"],
            {"chosen": [U("q"), A("a")], "prompt": "q"},
        )
        == "ultrafeedback"
    )
    assert detect_format(["chosen", "rejected"], {"chosen": "\n\nHuman: q\n\nAssistant: a"}) == "hh"
    assert detect_format(["chosen", "rejected"], {"chosen": "x y"}) == "implicit"
    assert detect_format(["chosen", "rejected"], {"chosen": [U("q")]}) == "conversational_implicit"
    assert (
        detect_format(["history", "human_ref_A", "human_ref_B", "labels", "score_ratio"], None)
        == "shp"
    )
    assert detect_format(["qid", "question", "answers"], None) == "se"
    assert detect_format(["instruction", "input", "output"], None) == "alpaca"
    with pytest.raises(
        ValueError,
        match=r"cannot tell the data format of the data from its columns \['text'\]: set "
        r"data.format",
    ):
        detect_format(["text"], {"text": "x"})
    with pytest.raises(ValueError) as e:  # TRL's KTO columns with a misspelt completion
        detect_format(["prompt", "response", "label"], {"prompt": "q", "response": "a"}, "k.jsonl")
    assert str(e.value).startswith(
        "cannot tell the data format of k.jsonl from its columns ['label', 'prompt', 'response']; "
        "nearest: 'unpaired_conversational' / 'unpaired', which also need ['completion']: set "
        "data.format to one of"
    )
    with pytest.raises(
        ValueError,
        match=r"nearest: 'standard' / 'ultrafeedback' / "
        r"'conversational', which also need \['chosen', 'rejected'\]",
    ):
        detect_format(["prompt", "chosen_response", "rejected_response"], {"prompt": "q"})


def test_common_prefix_never_splits_a_word():
    # TRL would give "I like ca" | "ts a lot." (a token the model never emits after the prompt).
    assert common_text_prefix("I like cats a lot.", "I like cars a lot.") == "I like"
    assert common_text_prefix("The sky is blue", "The sky is red") == "The sky is"
    assert common_text_prefix("abc", "abd") == ""


def test_hh_pair_diverging_before_the_last_turn_is_split_at_the_common_assistant_turn():
    """An HH pair whose dialogues differ before their last Assistant turn is split at the last
    Assistant turn inside their common prefix and noted ``diverged_early``; it is neither a
    RowError nor, with on_error=skip, dropped as malformed."""
    row = {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Sky?\n\nAssistant: Blue.",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Go away.\n\nHuman: Sky?\n\nAssistant: No.",
    }
    assert convert_hh(row, CFG) == [
        Example(
            [U("Hi")],
            [A("Hello!"), U("Sky?"), A("Blue.")],
            [A("Go away."), U("Sky?"), A("No.")],
            notes=("diverged_early",),
        )
    ]
    # The common text runs into the second Assistant turn ("Hello" vs "Hello there"): the split
    # is still at the last marker wholly inside the common prefix.
    row = {
        "chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: x\n\nAssistant: y",
        "rejected": "\n\nHuman: Hi\n\nAssistant: Hello there\n\nHuman: x\n\nAssistant: z",
    }
    assert convert_hh(row, CFG)[0].prompt == [U("Hi")]
