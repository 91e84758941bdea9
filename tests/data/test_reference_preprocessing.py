"""``data.reference_preprocessing``: hh / shp / se rows in the hub datasets' exact schemas, read
from small local files through the real pipeline (reader, format detection, converter, tokenizer),
give the prompts and completions the reference DPO repo's ``preference_datasets.py`` makes of them
(expected texts written out by hand from its code)."""

import pytest

from dpo_megatron.data import DataConfig, load_preference_pairs, load_sft_examples
from tests.data.fixtures import tiny_hf_tokenizer, write_jsonl

EOS = "<|im_end|>"


def _load(path, **kwargs):
    tok = tiny_hf_tokenizer()
    cfg = DataConfig(
        path=str(path),
        reference_preprocessing=True,
        cache_dir="none",
        verbose=False,
        shuffle=False,
        max_length=2048,
        max_prompt_length=1024,
        **kwargs,
    )
    data = load_preference_pairs(cfg, tok)
    return [
        (tok.decode(p.prompt_ids), tok.decode(p.chosen_ids), tok.decode(p.rejected_ids))
        for p in data.train
    ], data.summary


# Anthropic/hh-rlhf: {"chosen": str, "rejected": str}
HH_ROWS = [
    {
        "chosen": "\n\nHuman: What colour is the sky?\n\nAssistant: It is blue.",
        "rejected": "\n\nHuman: What colour is the sky?\n\nAssistant: It is green.",
    },
    # diverges before the last turn: the second Assistant answer differs, then a further turn
    {
        "chosen": "\n\nHuman: Hello!\n\nAssistant: Hello, how are you?\n\nHuman: I am fine."
        "\n\nAssistant: Thank you.",
        "rejected": "\n\nHuman: Hello!\n\nAssistant: No.\n\nHuman: I am fine.\n\nAssistant: Yes.",
    },
]


def test_hh_text_prompts_and_early_divergence(tmp_path):
    got, summary = _load(write_jsonl(tmp_path / "hh.jsonl", HH_ROWS))
    assert got == [
        # the last '\n\nAssistant:' ends the prompt; the completion keeps its leading space
        (
            "\n\nHuman: What colour is the sky?\n\nAssistant:",
            " It is blue." + EOS,
            " It is green." + EOS,
        ),
        # the longest common prefix ending in '\n\nAssistant:' (the reference repo's rfind on
        # chosen would have cut at the last turn and given rejected a mangled tail)
        (
            "\n\nHuman: Hello!\n\nAssistant:",
            " Hello, how are you?\n\nHuman: I am fine.\n\nAssistant: Thank you." + EOS,
            " No.\n\nHuman: I am fine.\n\nAssistant: Yes." + EOS,
        ),
    ]


def test_hh_sft_examples_are_prompt_and_chosen(tmp_path):
    tok = tiny_hf_tokenizer()
    cfg = DataConfig(
        path=str(write_jsonl(tmp_path / "hh.jsonl", HH_ROWS[:1])),
        cache_dir="none",
        reference_preprocessing=True,
        verbose=False,
        shuffle=False,
    )
    (ex,) = load_sft_examples(cfg, tok).train
    assert tok.decode(ex.prompt_ids) == "\n\nHuman: What colour is the sky?\n\nAssistant:"
    assert tok.decode(ex.completion_ids) == " It is blue." + EOS


def _shp_row(post, a, b, score_a, score_b, label):
    """One row of stanfordnlp/SHP with all its columns."""
    return {
        "post_id": post,
        "domain": "askscience_train",
        "upvote_ratio": 0.99,
        "history": f"Why is the sky {post}?",
        "c_root_id_A": "a" + post,
        "c_root_id_B": "b" + post,
        "created_at_utc_A": 1,
        "created_at_utc_B": 2,
        "score_A": score_a,
        "score_B": score_b,
        "human_ref_A": a,
        "human_ref_B": b,
        "labels": label,
        "seconds_difference": 1.0,
        "score_ratio": max(score_a, score_b) / min(score_a, score_b),
    }


def test_shp_ratio_filter_and_label_direction(tmp_path):
    rows = [
        _shp_row("blue", "Rayleigh scattering.", "It is not.", 10, 3, 1),
        _shp_row("dark", "It is night.", "Space.", 4, 12, 0),
        _shp_row("grey", "Clouds.", "Smoke.", 5, 3, 1),
    ]  # ratio 1.67 < 2: dropped
    got, _ = _load(write_jsonl(tmp_path / "shp.jsonl", rows))
    assert got == [
        (
            "\n\nHuman: Why is the sky blue?\n\nAssistant:",
            " Rayleigh scattering." + EOS,
            " It is not." + EOS,
        ),
        ("\n\nHuman: Why is the sky dark?\n\nAssistant:", " Space." + EOS, " It is night." + EOS),
    ]


def _se_row(question, answers):
    """One row of HuggingFaceH4/stack-exchange-preferences with all its columns."""
    return {
        "qid": 1,
        "question": question,
        "date": "2010/01/01",
        "metadata": ["https://x"],
        "answers": [
            {
                "answer_id": i,
                "author": "u",
                "author_id": i,
                "author_profile": "p",
                "pm_score": score,
                "selected": False,
                "text": text,
            }
            for i, (score, text) in enumerate(answers)
        ],
    }


def test_se_html_rule_and_every_pair(tmp_path):
    question = (
        "<p>How do I <em>print</em> in Python?</p>\n<pre><code>print(x)\n</code></pre>"
        "<div>dropped</div>"
    )
    rows = [
        _se_row(
            question,
            [
                (1, "<p>Use print.</p>"),
                (3, "<p>Call <code>print</code>()</p><code>print(1)</code>"),
                (1, "<p>Tie.</p>"),
            ],
        )
    ]
    got, _ = _load(write_jsonl(tmp_path / "se.jsonl", rows))
    # <p> keeps its direct text only (the <em> word goes), <pre> gives <code>...</code>, other
    # top-level tags are dropped; parts joined by blank lines (strip_html_tags of the repo)
    prompt = "\n\nHuman: How do I  in Python?\n\n<code>print(x)\n</code>\n\nAssistant:"
    a0, a1, a2 = " Use print.", " Call ()\n\n<code>print(1)</code>", " Tie."
    # every pair i < j in file order, higher pm_score chosen; the tie (0, 2) chooses answer 2
    assert got == [
        (prompt, a1 + EOS, a0 + EOS),
        (prompt, a2 + EOS, a0 + EOS),
        (prompt, a1 + EOS, a2 + EOS),
    ]


def test_without_the_flag_hh_stays_conversational(tmp_path):
    from dpo_megatron.data.formats import Example, convert_hh

    row = HH_ROWS[0]
    (ex,) = convert_hh(row, DataConfig())
    assert ex == Example(
        [{"role": "user", "content": "What colour is the sky?"}],
        [{"role": "assistant", "content": "It is blue."}],
        [{"role": "assistant", "content": "It is green."}],
    )
    (ex,) = convert_hh(row, DataConfig(reference_preprocessing=True))
    assert ex.notes == ()
    (early,) = convert_hh(HH_ROWS[1], DataConfig(reference_preprocessing=True))
    assert early.notes == ("diverged_early",)


@pytest.mark.parametrize("name", ["hh", "shp", "se"])
def test_reference_dataset_names_are_the_hub_ones(name):
    from dpo_megatron.frontends.dpo_repo import REFERENCE_DATASETS

    assert (
        REFERENCE_DATASETS[name]
        == {
            "hh": ("Anthropic/hh-rlhf", "hh"),
            "shp": ("stanfordnlp/SHP", "shp"),
            "se": ("HuggingFaceH4/stack-exchange-preferences", "se"),
        }[name]
    )


def test_shp_at_most_five_pairs_per_post(tmp_path):
    """Post "blue" has six pairs with score ratio >= 2 (and one under it, in the middle); the
    cap keeps its first five in file order, counted per post_id across an interleaved post."""
    rows = [
        _shp_row("blue", f"Answer {i}.", f"Wrong {i}.", 5 if i == 2 else 10, 3, 1) for i in range(7)
    ]
    rows.insert(2, _shp_row("dark", "Space.", "It is night.", 12, 4, 1))
    path = write_jsonl(tmp_path / "shp.jsonl", rows)
    got, summary = _load(path)
    blue = "\n\nHuman: Why is the sky blue?\n\nAssistant:"
    assert [(p, c) for p, c, _ in got] == [
        (blue, " Answer 0." + EOS),
        (blue, " Answer 1." + EOS),
        ("\n\nHuman: Why is the sky dark?\n\nAssistant:", " Space." + EOS),
        (blue, " Answer 3." + EOS),
        (blue, " Answer 4." + EOS),
        (blue, " Answer 5." + EOS),
    ]
    assert summary.dropped == {"score_ratio": 1, "shp_pairs_per_post": 1}  # Answer 2, 6
    got, summary = _load(path, shp_max_pairs_per_post=0)  # no cap: the reference repo's set
    assert len(got) == 7 and summary.dropped == {"score_ratio": 1}
    got, _ = _load(path, shp_max_pairs_per_post=1)
    assert [c for _, c, _ in got] == [" Answer 0." + EOS, " Space." + EOS]
