"""A file ``python -m dpo_megatron.generate`` writes, read by the stages after it: the scorer
(``python -m dpo_megatron.score``), a preference row built from two of its rows (the data path
that DPO trains on) and an online prompts file, each feed the model the prompt ids the policy was
sampled after, for a text prompt through the chat template, a ``messages`` prompt, and a text
with ``generation.apply_chat_template=false``. No model: the completions are fixed ids."""

from __future__ import annotations

import json

import pytest

from dpo_megatron.data import DataConfig, load_preference_pairs
from dpo_megatron.data.encode import encode_settings
from dpo_megatron.generation.files import completion_rows, encode_prompts
from dpo_megatron.online.prompts import encode_prompts as online_encode_prompts
from dpo_megatron.reward.rows import encode_rows, read_rows
from tests.data.fixtures import tiny_hf_tokenizer, write_jsonl

TEXT = "What colour is the sky?"
MESSAGES = [{"role": "user", "content": "Hello! How are you?"}]
CASES = {  # name: (prompt row value, generation.apply_chat_template)
    "text_through_template": (TEXT, True),
    "messages": (MESSAGES, True),
    "text_as_it_stands": (TEXT, False),
}
COMPLETIONS = ("It is blue.", "Blue, mostly.")


def _smollm2():
    from dpo_megatron.data import load_tokenizer
    from tests.scripts import load_script

    return load_tokenizer(str(load_script("assets").ensure_smollm2()))


TOKENIZERS = {"tiny": tiny_hf_tokenizer, "smollm2": _smollm2}
_LOADED = {}


def _tokenizer(kind):
    if kind not in _LOADED:
        _LOADED[kind] = TOKENIZERS[kind]()
    return _LOADED[kind]


def _generated_rows(tokenizer, prompt, apply_chat_template, path):
    """(the prompt ids sampled from, the rows written as generate writes them, read back)."""
    encoded = encode_prompts(
        [prompt], tokenizer, encode_settings(tokenizer, None), apply_chat_template
    )
    eos = tokenizer.eos_token_id
    samples = [[*tokenizer.encode(c, add_special_tokens=False), eos] for c in COMPLETIONS]
    rows = completion_rows(encoded.prompts, [samples], tokenizer)
    write_jsonl(path, rows)
    return encoded.prompt_ids[0], [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("kind", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_stage_reads_the_prompt_ids_generation_sampled_from(tmp_path, kind, case):
    """The row's ``prompt`` is the form sampled (a one-user-turn message list for a text through
    the template, the text itself when sent as it stands); the scorer's sequences start with the
    sampled prompt ids, so do a DPO pair's (its completions as TRL's row of that prompt form)
    and an online run's prompt read from the same form."""
    tokenizer = _tokenizer(kind)
    prompt, apply_chat_template = CASES[case]
    generated = tmp_path / "generations.jsonl"
    sampled, rows = _generated_rows(tokenizer, prompt, apply_chat_template, generated)

    assert [r["completion"] for r in rows] == list(COMPLETIONS)
    if case == "text_through_template":
        assert rows[0]["prompt"] == [{"role": "user", "content": TEXT}]
        bare = tokenizer.encode(TEXT, add_special_tokens=False)
        assert sampled != bare and tokenizer.decode(sampled).count(TEXT) == 1
    else:
        assert rows[0]["prompt"] == prompt

    sequences, starts = encode_rows(read_rows(str(generated)), str(generated), tokenizer, "")
    assert [s[:n] for s, n in zip(sequences, starts)] == [sampled, sampled]

    form = rows[0]["prompt"]
    chosen, rejected = (
        [{"role": "assistant", "content": r["completion"]}]
        if isinstance(form, list)
        else r["completion"]
        for r in rows
    )
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": form, "chosen": chosen, "rejected": rejected}]
    )
    dataset = load_preference_pairs(
        DataConfig(path=str(pairs), cache_dir="none", verbose=False), tokenizer
    )
    assert [list(p.prompt_ids) for p in dataset.train] == [sampled]

    (item,), too_long = online_encode_prompts([(0, form)], tokenizer)
    assert (list(item.prompt_ids), too_long) == (sampled, 0)
