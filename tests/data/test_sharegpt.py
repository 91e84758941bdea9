"""The main job's path: ShareGPT / LLaMA-Factory rows -> pairs, with a ChatML tokenizer and with
SentencePiece (Mistral template); ids checked against the tokenizer applied by hand."""

from dpo_megatron.data import DataConfig, load_preference_pairs
from dpo_megatron.data.tokenizer import BUILTIN_CHAT_TEMPLATES
from tests.data.fixtures import mistral_sp_tokenizer, tiny_hf_tokenizer, write_json

ROWS = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What colour is the sky?"},
        ],
        "chosen": {"from": "gpt", "value": "It is blue."},
        "rejected": {"from": "gpt", "value": "It is green."},
    },
    {
        "conversations": [
            {"from": "human", "value": "Hello!"},
            {"from": "gpt", "value": "Hello! How are you?"},
            {"from": "human", "value": "I am fine. Answer: yes or no?"},
        ],
        "chosen": {"from": "gpt", "value": "yes"},
        "rejected": {"from": "gpt", "value": "no"},
    },
]


def _load(tmp_path, tok, **kw):
    path = write_json(tmp_path / "dpo.json", ROWS)
    return load_preference_pairs(
        DataConfig(path=str(path), cache_dir="none", verbose=False, **kw), tok
    )


def test_sharegpt_chatml_ids_by_hand(tmp_path):
    tok = tiny_hf_tokenizer()
    ds = _load(tmp_path, tok)
    assert ds.summary.sources[0].format == "sharegpt"  # auto-detected
    assert (ds.summary.rows_read, ds.summary.kept, len(ds.train), len(ds.eval)) == (
        2,
        2,
        2,
        0,
    )
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    p0 = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat colour is the sky?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ds.train[0].prompt_ids == tuple(enc(p0))
    assert ds.train[0].chosen_ids == tuple(enc("It is blue.") + [2])
    assert ds.train[0].rejected_ids == tuple(enc("It is green.") + [2])
    # the system turn is included; a completion ends with exactly one <|im_end|> (id 2), and the
    # prompt + completion are exactly the joint tokenization of the rendered conversation
    head = enc("<|im_start|>system\nBe brief.")
    assert ds.train[0].prompt_ids[: len(head)] == tuple(head)
    assert ds.train[0].prompt_ids + ds.train[0].chosen_ids == tuple(
        enc(p0 + "It is blue.<|im_end|>")
    )
    p1 = (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHello! How are you?<|im_end|>\n"
        "<|im_start|>user\nI am fine. Answer: yes or no?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ds.train[1].prompt_ids == tuple(enc(p1))
    assert ds.train[1].chosen_ids == tuple(enc("yes") + [2])
    assert ds.train[1].rejected_ids == tuple(enc("no") + [2])
    for pair in ds.train:
        for completion in (pair.chosen_ids, pair.rejected_ids):
            assert completion[-1] == 2 and completion.count(2) == 1


def test_sharegpt_sentencepiece_mistral_template_by_hand(tmp_path):
    tok = mistral_sp_tokenizer()
    ds = _load(tmp_path, tok, chat_template="mistral")
    sp = tok._sp
    # "<s>[INST] Be brief.\n\nWhat colour is the sky? [/INST]" then " It is blue.</s>"
    assert ds.train[0].prompt_ids == (
        1,
        *sp.encode("[INST] Be brief.\n\nWhat colour is the sky? [/INST]"),
    )
    assert ds.train[0].chosen_ids == (*sp.encode("It is blue."), 2)  # "▁It" with its space, no BOS
    assert sp.id_to_piece(ds.train[0].chosen_ids[0]) == "\u2581It"
    assert ds.train[0].rejected_ids == (*sp.encode("It is green."), 2)
    # second row: turn 1 answer ends with </s>, then a new [INST] segment
    expected = [1, *sp.encode("[INST] Hello! [/INST] Hello! How are you?"), 2]
    expected += sp.encode("[INST] I am fine. Answer: yes or no? [/INST]")
    assert ds.train[1].prompt_ids == tuple(expected)
    assert ds.train[1].chosen_ids == (*sp.encode("yes"), 2)
    assert BUILTIN_CHAT_TEMPLATES["mistral"]
