"""A file ``python -m dpo_megatron.generate`` writes, read by the stages after it: the scorer
(``python -m dpo_megatron.score``), a preference row built from two of its rows (the data path
that DPO trains on) and an online prompts file, each feed the model the prompt ids the policy was
sampled after, for a text prompt through the chat template, a ``messages`` prompt, and a text
with ``generation.apply_chat_template=false``; the scorer reads the completion ids sampled
(``completion_ids``) as they are. No model: the completions are fixed ids."""

from __future__ import annotations

import json

import pytest

from dpo_megatron.data import DataConfig, load_preference_pairs
from dpo_megatron.data.encode import encode_settings
from dpo_megatron.data.sources import DataError
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


def _generated_rows(tokenizer, prompt, apply_chat_template, path, samples=None):
    """(the prompt ids sampled from, the rows written as generate writes them, read back);
    ``samples`` (completion ids) default to :data:`COMPLETIONS` encoded, each ending in EOS."""
    encoded = encode_prompts(
        [prompt], tokenizer, encode_settings(tokenizer, None), apply_chat_template
    )
    eos = tokenizer.eos_token_id
    if samples is None:
        samples = [[*tokenizer.encode(c, add_special_tokens=False), eos] for c in COMPLETIONS]
    rows = completion_rows(encoded, [samples], tokenizer)
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

    scored = encode_rows(read_rows(str(generated)), str(generated), tokenizer, "")
    assert [s[:n] for s, n in zip(scored.sequences, scored.starts)] == [sampled, sampled]
    assert [r["prompt_ids"] for r in rows] == [sampled, sampled]
    assert scored.retokenized == 0

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


def _split_ids(tokenizer, text):
    """Ids of ``text`` one character a token: ids a sampler may draw, which encoding the decoded
    text merges into fewer tokens."""
    return [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]


@pytest.mark.parametrize("kind", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_scorer_reads_the_sampled_completion_ids(tmp_path, kind, case):
    """The scorer's sequence of a generated row is its prompt ids then exactly its
    ``completion_ids``: a completion cut at ``max_new_tokens`` gets no end token it never
    sampled, one ending in EOS keeps it, and ids whose decoded text re-tokenizes otherwise are
    kept as sampled. The same rows without ``completion_ids`` (hand-written) are their text
    re-tokenized with an end token appended, as before."""
    tokenizer = _tokenizer(kind)
    prompt, apply_chat_template = CASES[case]
    eos = tokenizer.eos_token_id
    cut = tokenizer.encode(COMPLETIONS[0], add_special_tokens=False)
    ended = [*tokenizer.encode(COMPLETIONS[1], add_special_tokens=False), eos]
    split = [*_split_ids(tokenizer, COMPLETIONS[0]), eos]
    assert cut[-1] != eos and cut != split[:-1]  # the cases are what they claim
    assert tokenizer.decode(split, skip_special_tokens=True) == COMPLETIONS[0]
    generated = tmp_path / "generations.jsonl"
    samples = [cut, ended, split]
    sampled, rows = _generated_rows(tokenizer, prompt, apply_chat_template, generated, samples)

    scored = encode_rows(read_rows(str(generated)), str(generated), tokenizer, "")
    sequences, starts = scored.sequences, scored.starts
    assert sequences == [[*sampled, *ids] for ids in samples]
    assert starts == [len(sampled)] * 3

    handwritten = write_jsonl(
        tmp_path / "handwritten.jsonl",
        [{k: v for k, v in r.items() if k != "completion_ids"} for r in rows],
    )
    text_rows = encode_rows(read_rows(str(handwritten)), str(handwritten), tokenizer, "")
    texts, text_starts = text_rows.sequences, text_rows.starts
    assert text_starts == starts
    assert texts[0][-1] in tokenizer.all_special_ids and texts[0] != sequences[0]
    assert texts[2] == texts[0] != sequences[2]


@pytest.mark.parametrize(
    "value, message",
    [
        ("12", r"expected a list of token ids, got str"),
        ([5, "6"], r"entry 1 is '6', not a token id"),
        ([5, True], r"entry 1 is True, not a token id"),
        ([5, 6.0], r"entry 1 is 6.0, not a token id"),
        ([-1], r"entry 0 is -1, outside the tokenizer's vocabulary"),
        ("past the vocabulary", r"entry 0 is \d+, outside the tokenizer's vocabulary"),
    ],
)
def test_bad_completion_ids_are_named_by_file_line_and_field(tmp_path, value, message):
    """A ``completion_ids`` that is not a list of the tokenizer's ids stops the scorer with one
    line naming the file, the line and the field; an empty list has nothing to score."""
    tokenizer = _tokenizer("tiny")
    if value == "past the vocabulary":
        value = [len(tokenizer)]
    good = {"prompt": TEXT, "completion": "Blue.", "completion_ids": [5, 6]}
    path = write_jsonl(tmp_path / "gen.jsonl", [good, {**good, "completion_ids": value}])
    with pytest.raises(DataError, match=rf"gen.jsonl: line 2: field 'completion_ids': {message}"):
        encode_rows(read_rows(str(path)), str(path), tokenizer, "")
    path = write_jsonl(tmp_path / "empty.jsonl", [{**good, "completion_ids": []}])
    with pytest.raises(DataError, match=r"empty.jsonl: line 1: nothing to score"):
        encode_rows(read_rows(str(path)), str(path), tokenizer, "")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_reward_model_of_another_family_reads_the_completion_text(tmp_path, case):
    """Rows sampled with one tokenizer (the tiny BPE) and scored with another (Mistral's
    SentencePiece, its chat template): the scorer's ids of the prompt differ from the row's
    ``prompt_ids``, so the sampled ids, which are not its tokens, are not read; each completion's
    text is, exactly as the same row without ``completion_ids`` is read, and a completion that
    stopped at once (blank text) is the scorer's EOS after its prompt. All are counted."""
    from tests.data.fixtures import mistral_sp_tokenizer

    policy, scorer = _tokenizer("tiny"), mistral_sp_tokenizer()
    prompt, apply_chat_template = CASES[case]
    eos = policy.eos_token_id
    samples = [[*policy.encode(c, add_special_tokens=False), eos] for c in COMPLETIONS] + [[eos]]
    generated = tmp_path / "generations.jsonl"
    _, rows = _generated_rows(policy, prompt, apply_chat_template, generated, samples)
    assert rows[2]["completion"] == ""

    scored = encode_rows(read_rows(str(generated)), str(generated), scorer, "mistral")
    handwritten = write_jsonl(
        tmp_path / "handwritten.jsonl",
        [{k: v for k, v in r.items() if k != "completion_ids"} for r in rows[:2]],
    )
    texts = encode_rows(read_rows(str(handwritten)), str(handwritten), scorer, "mistral")
    assert scored.retokenized == 3 and texts.retokenized == 0
    assert scored.sequences[:2] == texts.sequences and scored.starts[:2] == texts.starts
    prompt_ids = scored.sequences[2][: scored.starts[2]]
    assert prompt_ids == texts.sequences[0][: texts.starts[0]] and prompt_ids[0] == 1  # <s>
    assert scored.sequences[2] == [*prompt_ids, scorer.eos_token_id]

    # The generating tokenizer itself reads every row as sampled.
    same = encode_rows(read_rows(str(generated)), str(generated), policy, "")
    assert same.retokenized == 0
    assert [s[n:] for s, n in zip(same.sequences, same.starts)] == samples


def test_bad_prompt_ids_are_named_by_file_line_and_field(tmp_path):
    """A ``prompt_ids`` that is not a list of ids stops the scorer with one line naming the
    file, the line and the field."""
    good = {"prompt": TEXT, "completion": "Blue.", "completion_ids": [5, 6], "prompt_ids": [7]}
    path = write_jsonl(tmp_path / "gen.jsonl", [good, {**good, "prompt_ids": [7, "8"]}])
    with pytest.raises(DataError, match=r"gen.jsonl: line 2: field 'prompt_ids': entry 1 is '8'"):
        encode_rows(read_rows(str(path)), str(path), _tokenizer("tiny"), "")
