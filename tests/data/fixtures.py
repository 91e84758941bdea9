"""Small tokenizers and fixture-file writers shared by the data tests."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The sky is blue. The grass is green. What colour is the sky? It is blue, it is green.",
    "Hello! How are you? I am fine, thank you. Answer: yes or no.",
]


@lru_cache(maxsize=1)
def tiny_hf_tokenizer():
    """A byte-level BPE (GPT-2 / SmolLM2 style: no BOS added) trained in-process on a few
    sentences, with ChatML special tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 (EOS,
    pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = CHATML
    return tok


def mistral_sp_tokenizer():
    """Mistral-7B v0.1's SentencePiece model (vocab 32000, <unk>=0, <s>=1, </s>=2) via our
    wrapper."""
    from tests.scripts import load_script

    ensure_sentencepiece_model = load_script("assets").ensure_sentencepiece_model
    from dpo_megatron.data.tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(ensure_sentencepiece_model())


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_json(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows, indent=1))
    return path
