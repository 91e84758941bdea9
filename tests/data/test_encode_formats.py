"""Every format, end to end: a fixture file written here -> pairs whose prompt/chosen/rejected ids
equal the tokenizer applied by hand. Tokenizers: a byte-level BPE with a ChatML template (fast),
Mistral's SentencePiece model with the built-in Mistral template (fast), and SmolLM2 (slow)."""

import re

import pytest

from dpo_megatron.data import DataConfig, load_preference_pairs, load_sft_examples
from tests.data.fixtures import mistral_sp_tokenizer, tiny_hf_tokenizer, write_json, write_jsonl

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
Q = "What colour is the sky?"
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class ByHand:
    """Expected ids for one tokenizer, computed with the tokenizer's own encode on hand-built
    text."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "hf":
            self.tok = tiny_hf_tokenizer()
        elif kind == "sp":
            self.tok = mistral_sp_tokenizer()
        else:
            from tests.scripts import load_script

            ensure_smollm2 = load_script("assets").ensure_smollm2
            from dpo_megatron.data import load_tokenizer

            self.tok = load_tokenizer(str(ensure_smollm2()))
        self.chat_template = "mistral" if kind == "sp" else ""

    def enc(self, s):
        if (
            self.kind == "sp"
        ):  # split at control symbols; each segment gets SentencePiece's dummy prefix
            ids = []
            for part in re.split(r"(<s>|</s>)", s):
                ids += (
                    [1]
                    if part == "<s>"
                    else [2]
                    if part == "</s>"
                    else self.tok._sp.encode(part)
                    if part
                    else []
                )
            return ids
        return self.tok.encode(s, add_special_tokens=False)

    def text(self, prompt, chosen, rejected):
        if (
            self.kind == "sp"
        ):  # BOS first; " blue." after a prompt is "▁blue" "." = sp.encode("blue.")
            return [1, *self.enc(prompt)], [*self.enc(chosen[1:]), 2], [*self.enc(rejected[1:]), 2]
        return self.enc(prompt), [*self.enc(chosen), 2], [*self.enc(rejected), 2]

    def chat(self, messages, chosen, rejected):
        if self.kind == "sp":
            text, system = "<s>", ""
            for m in messages:
                if m["role"] == "system":
                    system = m["content"] + "\n\n"
                elif m["role"] == "user":
                    text += f"[INST] {system}{m['content']} [/INST]"
                    system = ""
                else:
                    text += f" {m['content']}</s>"
            return self.enc(text), [*self.enc(chosen), 2], [*self.enc(rejected), 2]
        if self.kind == "smollm2" and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": SMOL_SYSTEM}, *messages]
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n"
        return self.enc(text), [*self.enc(chosen), 2], [*self.enc(rejected), 2]


TEXT = ("The sky is", " blue.", " green.")
CHAT = ([U(Q)], "It is blue.", "It is green.")
CASES = {
    "standard": ([{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}], "text"),
    "implicit": ([{"chosen": "The sky is blue.", "rejected": "The sky is green."}], "text"),
    "conversational": (
        [{"prompt": [U(Q)], "chosen": [A("It is blue.")], "rejected": [A("It is green.")]}],
        "chat",
    ),
    "conversational_implicit": (
        [{"chosen": [U(Q), A("It is blue.")], "rejected": [U(Q), A("It is green.")]}],
        "chat",
    ),
    "sharegpt": (
        [
            {
                "conversations": [{"from": "human", "value": Q}],
                "chosen": {"from": "gpt", "value": "It is blue."},
                "rejected": {"from": "gpt", "value": "It is green."},
            }
        ],
        "chat",
    ),
    "hh": (
        [
            {
                "chosen": f"\n\nHuman: {Q}\n\nAssistant: It is blue.",
                "rejected": f"\n\nHuman: {Q}\n\nAssistant: It is green.",
            }
        ],
        "chat",
    ),
    "shp": (
        [
            {
                "history": Q,
                "human_ref_A": "It is green.",
                "human_ref_B": "It is blue.",
                "labels": 0,
                "score_A": 1,
                "score_B": 9,
                "score_ratio": 9.0,
            }
        ],
        "chat",
    ),
    "se": (
        [
            {
                "qid": 1,
                "question": f"<p>{Q}</p>",
                "answers": [
                    {"answer_id": 1, "text": "<p>It is green.</p>", "pm_score": 0},
                    {"answer_id": 2, "text": "<p>It is <b>blue</b>.</p>", "pm_score": 4},
                ],
            }
        ],
        "chat",
    ),
    "ultrafeedback": (
        [
            {
                "prompt": Q,
                "prompt_id": "x",
                "chosen": [U(Q), A("It is blue.")],
                "rejected": [U(Q), A("It is green.")],
                "score_chosen": 9.0,
                "score_rejected": 2.0,
            }
        ],
        "chat",
    ),
}
KINDS = ["hf", "sp", pytest.param("smollm2", marks=pytest.mark.slow)]
_HANDS = {}


def hand(kind):
    if kind not in _HANDS:
        _HANDS[kind] = ByHand(kind)
    return _HANDS[kind]


def _write(tmp_path, name, rows):
    if name == "shp":  # one format through parquet, one through a JSON array, the rest JSON Lines
        import datasets

        path = tmp_path / f"{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        return path
    if name == "sharegpt":
        return write_json(tmp_path / f"{name}.json", rows)
    return write_jsonl(tmp_path / f"{name}.jsonl", rows)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_format_ids_by_hand(tmp_path, kind, name):
    rows, shape = CASES[name]
    h = hand(kind)
    path = _write(tmp_path, name, rows)
    cfg = DataConfig(path=str(path), chat_template=h.chat_template, cache_dir="none", verbose=False)
    ds = load_preference_pairs(cfg, h.tok)
    assert ds.summary.sources[0].format == name  # auto-detected
    assert len(ds.train) == 1, ds.summary
    expected = h.text(*TEXT) if shape == "text" else h.chat(*CHAT)
    pair = ds.train[0]
    assert (list(pair.prompt_ids), list(pair.chosen_ids), list(pair.rejected_ids)) == tuple(
        expected
    )
    assert pair.chosen_ids.count(2) == 1 and pair.rejected_ids.count(2) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_text_split_equals_joint_tokenization(tmp_path, kind):
    """No boundary artefact: prompt + completion (minus EOS) is the tokenization of the whole
    text."""
    h = hand(kind)
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "Answer: yes or", "chosen": " no", "rejected": " yes"}]
    )
    pair = load_preference_pairs(
        DataConfig(path=str(path), cache_dir="none", verbose=False), h.tok
    ).train[0]
    joint = h.tok.encode("Answer: yes or no", add_special_tokens=(kind == "sp"))
    assert list(pair.prompt_ids + pair.chosen_ids[:-1]) == joint


@pytest.mark.parametrize("kind", KINDS)
def test_sft_view_and_alpaca(tmp_path, kind):
    h = hand(kind)
    sharegpt = write_jsonl(tmp_path / "p.jsonl", CASES["sharegpt"][0])
    sft = load_sft_examples(
        DataConfig(
            path=str(sharegpt), chat_template=h.chat_template, cache_dir="none", verbose=False
        ),
        h.tok,
    )
    prompt, chosen, _ = h.chat(*CHAT)
    assert (list(sft.train[0].prompt_ids), list(sft.train[0].completion_ids)) == (prompt, chosen)
    alpaca = write_json(
        tmp_path / "a.json", [{"instruction": Q, "input": "", "output": "It is blue."}]
    )
    sft = load_sft_examples(
        DataConfig(
            path=str(alpaca), chat_template=h.chat_template, cache_dir="none", verbose=False
        ),
        h.tok,
    )
    assert (list(sft.train[0].prompt_ids), list(sft.train[0].completion_ids)) == (prompt, chosen)
    with pytest.raises(ValueError, match="has no rejected answers; it serves the SFT stage only"):
        load_preference_pairs(
            DataConfig(path=str(alpaca), chat_template=h.chat_template, cache_dir="none"), h.tok
        )


@pytest.mark.parametrize("kind", KINDS)
def test_exactly_one_end_token(tmp_path, kind):
    """An EOS / end-of-turn already in the data is not doubled, with or without a chat template."""
    h = hand(kind)
    eos = "</s>" if kind == "sp" else "<|im_end|>"
    rows = [
        {"prompt": [U(Q)], "chosen": [A("It is blue." + eos)], "rejected": [A("It is green.")]},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    pair = load_preference_pairs(
        DataConfig(path=str(path), chat_template=h.chat_template, cache_dir="none", verbose=False),
        h.tok,
    ).train[0]
    _, chosen, rejected = h.chat(*CHAT)
    assert (list(pair.chosen_ids), list(pair.rejected_ids)) == (chosen, rejected)
    text = write_jsonl(
        tmp_path / "t.jsonl",
        [{"prompt": "The sky is", "chosen": " blue." + eos, "rejected": " green."}],
    )
    pair = load_preference_pairs(
        DataConfig(path=str(text), cache_dir="none", verbose=False), h.tok
    ).train[0]
    assert list(pair.chosen_ids) == h.text(*TEXT)[1]
