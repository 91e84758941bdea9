"""The real assets: LLaMA-Factory's dpo_en_demo (300 ShareGPT pairs) with the SmolLM2 tokenizer."""

import json

import pytest

from dpo_megatron.data import DataConfig, load_preference_pairs, load_sft_examples, load_tokenizer
from tests.scripts import load_script

assets = load_script("assets")  # builds a missing asset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(str(assets.ensure_smollm2()))


@pytest.mark.parametrize("max_length", [512, 1024])
def test_dpo_en_demo_loads_with_summary(smollm2_tokenizer, max_length, capsys, tmp_path):
    tok = smollm2_tokenizer
    path = assets.ensure_dpo_en_demo()
    cfg = DataConfig(
        path=str(path),
        max_length=max_length,
        max_prompt_length=max_length // 2,
        cache_dir=str(tmp_path),
    )
    ds = load_preference_pairs(cfg, tok)
    out = capsys.readouterr().out
    print(out)  # visible with -s: the start-up summary
    assert (
        f"data: 300 rows read, 300 pairs kept (300 train, 0 eval), max_length {max_length}" in out
    )
    assert "dropped by reason: none" in out
    assert ds.summary.sources[0].format == "sharegpt"
    for pair in ds.train:
        assert len(pair.prompt_ids) <= max_length // 2
        assert (
            len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids)) <= max_length
        )
        for completion in (pair.chosen_ids, pair.rejected_ids):
            assert len(completion) >= 1
            assert completion.count(2) <= 1 and 2 not in completion[:-1]
    # the first row by hand: transformers' own chat template rendering, then encode
    row = json.loads(path.read_text())[0]
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    prompt_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    chosen = tok.encode(row["chosen"]["value"], add_special_tokens=False) + [2]
    pair = ds.train[0]
    assert list(pair.prompt_ids) == prompt[-(max_length // 2) :]
    assert list(pair.chosen_ids) == chosen[: max_length - len(pair.prompt_ids)]


def test_dpo_en_demo_without_prompt_cut_drops_long_prompts(smollm2_tokenizer, tmp_path):
    cfg = DataConfig(
        path=str(assets.ensure_dpo_en_demo()),
        max_length=512,
        max_prompt_length=0,
        cache_dir=str(tmp_path),
    )
    ds = load_preference_pairs(cfg, smollm2_tokenizer)
    # measured: 102 of the 300 prompts leave no room in 512 tokens (ASSETS.md: 98 pairs fit whole)
    assert ds.summary.dropped == {"prompt_too_long": 102}
    assert ds.summary.kept == 198


def test_alpaca_en_demo_sft_view(smollm2_tokenizer, tmp_path):
    cfg = DataConfig(
        path=str(assets.ensure_alpaca_en_demo()),
        max_length=512,
        cache_dir=str(tmp_path),
        eval_fraction=0.1,
    )
    sft = load_sft_examples(cfg, smollm2_tokenizer)
    assert sft.summary.rows_read == 999
    assert len(sft.train) + len(sft.eval) == sft.summary.kept > 990
    assert all(e.completion_ids for e in sft.train)


@pytest.mark.parametrize("name", ["dpo_en_demo", "dpo_zh_demo"])
def test_every_sequence_starts_with_one_bos_with_the_mistral_tokenizer(name, tmp_path):
    """Default length settings, Mistral's SentencePiece model (adds a BOS) with its chat
    template: every sequence of the real en and zh pairs starts with exactly one BOS, the cut
    prompts included."""
    from dpo_megatron.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(assets.ensure_sentencepiece_model())
    path = assets.ASSETS[name]()
    ds = load_preference_pairs(
        DataConfig(path=str(path), chat_template="mistral", cache_dir=str(tmp_path), verbose=False),
        tok,
    )
    assert len(ds.train) == 300
    for pair in ds.train:
        for sequence in (pair.prompt_ids + pair.chosen_ids, pair.prompt_ids + pair.rejected_ids):
            assert sequence[0] == tok.bos_token_id and sequence[1] != tok.bos_token_id
    cut = ds.summary.truncated
    # measured: en 136 prompts over 256 tokens (103 fit after dropping whole oldest turns), zh 70
    assert (cut["prompt"], cut["prompt_turns_dropped"], cut["prompt_tokens_cut"]) == (
        (136, 103, 33) if name == "dpo_en_demo" else (70, 0, 70)
    )
