"""The shipped word-count judge: words counted as the docstring says, the target read from the
prompt as the chat template renders it, scores computed by hand, and its prompts distinct and
the same for the same seed."""

from __future__ import annotations

import json

import pytest

from dpo_megatron.online.judges import (
    count_words,
    word_count,
    word_count_prompts,
    word_target,
    write_word_count_prompts,
)
from tests.data.fixtures import tiny_hf_tokenizer


def test_words_are_letters_and_digits_not_punctuation_or_markup():
    assert count_words("**Frosty** winter - a well-known, don't-stop 2024 season!") == 7
    assert count_words("  \n* - ...") == 0
    assert count_words("one\ntwo\tthree") == 3


def test_the_target_is_read_from_the_rendered_chat_prompt():
    tok = tiny_hf_tokenizer()
    row = word_count_prompts(1, seed=3)[0]
    rendered = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert word_target(rendered) == int(row["prompt"][0]["content"].split()[-2])
    with pytest.raises(ValueError, match="asks for no word count"):
        word_target("<|im_start|>user\nDescribe the sea.<|im_end|>")


def test_scores_by_hand():
    prompt = "Describe rain in exactly 8 words."
    completions = [
        "Rain falls softly on the quiet old roofs.",  # 8 words: 1
        "Rain falls softly.",  # 3 words: 1 - 5/8
        "Rain " * 12,  # 12 words: 1 - 4/8
        "Rain " * 16,  # 16 words: 0
        "",  # 0 words: 0
    ]
    assert word_count([prompt] * 5, completions) == pytest.approx([1.0, 0.375, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        word_count([prompt, prompt], ["a"])


def test_prompts_are_distinct_seeded_chat_rows(tmp_path):
    rows = word_count_prompts(200, seed=0)
    texts = [r["prompt"][0]["content"] for r in rows]
    assert len(set(texts)) == 200
    assert all(5 <= word_target(t) <= 15 for t in texts)
    assert rows == word_count_prompts(200, seed=0) != word_count_prompts(200, seed=1)
    path = tmp_path / "p.jsonl"
    write_word_count_prompts(path, count=7, seed=2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == word_count_prompts(7, 2)
    with pytest.raises(ValueError, match="distinct prompts"):
        word_count_prompts(10**6)
