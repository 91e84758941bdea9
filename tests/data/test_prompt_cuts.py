"""Prompt cuts: the BOS survives every cut, conversations lose whole oldest
turns before any token is cut, and each kind of cut is counted in the summary.

What these guard: a keep_end cut that slices ``prompt_ids[-max_prompt_length:]`` after the BOS
has been put at position 0 removes the BOS, and a conversation cut token-wise starts in the
middle of its oldest remaining turn.
"""

import pytest

from dpo_megatron.data import DataConfig, load_preference_pairs
from dpo_megatron.data.encode import EncodeSettings, exchanges, one_bos
from dpo_megatron.data.lengths import cut_prompt
from dpo_megatron.data.summary import format_summary
from tests.data.fixtures import mistral_sp_tokenizer, tiny_hf_tokenizer, write_jsonl

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731
BOS = 1


def _cfg(path, **kw):
    return DataConfig(path=str(path), cache_dir="none", verbose=False, **kw)


def test_cut_prompt_keeps_bos_and_the_last_tokens():
    """[1, 10, 11, 12, 13, 14] cut to 3 keeps the BOS and the last tokens: [1, 13, 14]."""
    ids = [BOS, 10, 11, 12, 13, 14]
    assert cut_prompt(ids, 3, "keep_end", BOS) == [BOS, 13, 14]
    assert cut_prompt(ids, 3, "keep_start", BOS) == [BOS, 10, 11]
    assert cut_prompt(ids, 6, "keep_end", BOS) == ids  # fits: untouched
    assert cut_prompt([10, 11, 12, 13], 2, "keep_end", BOS) == [12, 13]  # no BOS to keep
    assert cut_prompt(ids, 3, "keep_end") == [12, 13, 14]  # a tokenizer without BOS


def test_one_bos_adds_collapses_and_leaves_alone():
    adds = EncodeSettings(2, BOS, True, True, frozenset({2}), None)
    never = EncodeSettings(2, BOS, False, False, frozenset({2}), None)
    assert one_bos([5, 6], adds) == [BOS, 5, 6]
    assert one_bos([BOS, BOS, 5], adds) == [BOS, 5]
    assert one_bos([5, 6], never) == [5, 6]
    assert one_bos([BOS, BOS, 5], never) == [BOS, 5]


def test_text_prompts_cut_with_a_bos_tokenizer_keep_it(tmp_path):
    """Mistral's SentencePiece model adds a BOS: every cut text prompt still starts with it."""
    tok = mistral_sp_tokenizer()
    long = "The sky is blue and the grass is green " * 8
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": long + "so the sky is", "chosen": " blue.", "rejected": " green."},
            {"prompt": "Short one:", "chosen": " yes", "rejected": " no"},
        ],
    )
    ds = load_preference_pairs(_cfg(path, max_length=32, max_prompt_length=12), tok)
    full = [BOS, *tok.encode(long + "so the sky is", add_special_tokens=False)]
    cut, short = ds.train
    assert list(cut.prompt_ids) == [BOS, *full[-11:]]
    assert short.prompt_ids[0] == BOS and short.prompt_ids[1] != BOS
    assert ds.summary.truncated["prompt_tokens_cut"] == 1


def test_template_bos_is_never_doubled(tmp_path):
    """A text prompt that holds its own <s>, or a template that prints two: one BOS stays (not
    the encoder's BOS before the text's)."""
    tok = mistral_sp_tokenizer()
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"prompt": "<s>Hello there,", "chosen": " friend.", "rejected": " foe."}],
    )
    text = load_preference_pairs(_cfg(path), tok).train[0].prompt_ids
    assert list(text) == [BOS, *tok.encode("Hello there,", add_special_tokens=False)]
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"prompt": [U("Hi")], "chosen": [A("Hello.")], "rejected": [A("Go away.")]}],
    )
    twice = "{{ bos_token }}{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = load_preference_pairs(_cfg(path, chat_template=str(_write(tmp_path, twice))), tok)
    assert list(chat.train[0].prompt_ids) == [BOS, *tok.encode("Hi", add_special_tokens=False)]


def _write(tmp_path, template):
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return path


def test_exchanges_split_at_user_turns():
    system, units = exchanges([S("sys"), U("a"), A("b"), U("c"), A("d"), U("e")])
    assert system == [S("sys")]
    assert units == [[U("a"), A("b")], [U("c"), A("d")], [U("e")]]
    assert exchanges([A("hi"), U("q")]) == ([], [[A("hi")], [U("q")]])


def _chatml_ids(tok, messages):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return tok.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)


def test_conversation_drops_oldest_turns_first_keeping_the_system_message(tmp_path):
    """A long conversation loses its oldest whole turns first and keeps its system message;
    the prompt never starts inside a turn."""
    tok = tiny_hf_tokenizer()
    old = [U("The sky is blue. The grass is green."), A("It is blue, it is green.")] * 3
    prompt = [S("Answer: yes or no."), *old, U("Is the sky blue?")]
    kept = [S("Answer: yes or no."), U("Is the sky blue?")]
    budget = len(_chatml_ids(tok, kept)) + 2  # room for the last exchange only
    rows = [{"prompt": prompt, "chosen": [A("yes")], "rejected": [A("no")]}]
    ds = load_preference_pairs(
        _cfg(
            write_jsonl(tmp_path / "c.jsonl", rows), max_length=budget + 8, max_prompt_length=budget
        ),
        tok,
    )
    assert list(ds.train[0].prompt_ids) == _chatml_ids(tok, kept)
    assert ds.summary.truncated | {} == {
        "prompt": 1,
        "prompt_turns_dropped": 1,
        "prompt_tokens_cut": 0,
        "chosen": 0,
        "rejected": 0,
    }
    assert ds.summary.lengths_before_cut["prompt"].max == len(_chatml_ids(tok, prompt))
    # One more exchange fits: it is kept (only whole turns go, the newest stay).
    two = [S("Answer: yes or no."), *old[-2:], U("Is the sky blue?")]
    wider = len(_chatml_ids(tok, two))
    ds = load_preference_pairs(
        _cfg(
            write_jsonl(tmp_path / "d.jsonl", rows), max_length=wider + 8, max_prompt_length=wider
        ),
        tok,
    )
    assert list(ds.train[0].prompt_ids) == _chatml_ids(tok, two)
    assert "oldest turns dropped 1, tokens cut 0" in format_summary(ds.summary)


def test_one_turn_too_long_is_cut_inside_it(tmp_path):
    tok = tiny_hf_tokenizer()
    rows = [
        {
            "prompt": [U("old question"), A("old answer"), U("The sky is blue. " * 10)],
            "chosen": [A("yes")],
            "rejected": [A("no")],
        }
    ]
    ds = load_preference_pairs(
        _cfg(write_jsonl(tmp_path / "c.jsonl", rows), max_length=24, max_prompt_length=16), tok
    )
    last_only = _chatml_ids(tok, rows[0]["prompt"][-1:])
    assert list(ds.train[0].prompt_ids) == last_only[-16:]  # no BOS with this tokenizer
    assert ds.summary.truncated["prompt_turns_dropped"] == 1
    assert ds.summary.truncated["prompt_tokens_cut"] == 1
    # keep_start never drops turns: it keeps the first tokens.
    ds = load_preference_pairs(
        _cfg(
            write_jsonl(tmp_path / "d.jsonl", rows),
            max_length=24,
            max_prompt_length=16,
            truncation_mode="keep_start",
        ),
        tok,
    )
    assert list(ds.train[0].prompt_ids) == _chatml_ids(tok, rows[0]["prompt"])[:16]
    assert ds.summary.truncated["prompt_turns_dropped"] == 0


@pytest.mark.parametrize("mode", ["keep_end", "keep_start"])
def test_mistral_chat_cuts_keep_one_bos(tmp_path, mode):
    tok = mistral_sp_tokenizer()
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Tell me about the sky. " * 30},
            ],
            "chosen": {"from": "gpt", "value": "Blue."},
            "rejected": {"from": "gpt", "value": "Green."},
        }
    ]
    ds = load_preference_pairs(
        _cfg(
            write_jsonl(tmp_path / "s.jsonl", rows),
            chat_template="mistral",
            max_length=64,
            max_prompt_length=32,
            truncation_mode=mode,
        ),
        tok,
    )
    prompt = ds.train[0].prompt_ids
    assert len(prompt) == 32 and prompt[0] == BOS and BOS not in prompt[1:]
