"""Tokenizer loading and the SentencePiece wrapper's HF-like surface."""

import pickle
import shutil

import pytest

from dpo_megatron.data.tokenizer import (
    SentencePieceTokenizer,
    encode_continuation,
    load_tokenizer,
    prepends_space,
    resolve_chat_template,
    tokenizer_fingerprint,
)
from tests.data.fixtures import mistral_sp_tokenizer, tiny_hf_tokenizer
from tests.scripts import load_script

ensure_sentencepiece_model = load_script("assets").ensure_sentencepiece_model


def test_sentencepiece_wrapper_surface():
    tok = mistral_sp_tokenizer()
    sp = tok._sp
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (
        1,
        2,
        2,
        32000,
    )
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert tok.encode("The sky is blue.") == [1, *sp.encode("The sky is blue.")]
    assert tok.convert_ids_to_tokens(tok.encode("The sky", add_special_tokens=False)) == [
        "\u2581The",
        "\u2581sky",
    ]
    # control symbols written as text become their ids; each text segment gets the dummy prefix
    assert tok.encode("<s>Hi</s>", add_special_tokens=False) == [1, *sp.encode("Hi"), 2]
    # a continuation has no dummy prefix: "blue" inside a word, " blue" as a new word
    assert tok.convert_ids_to_tokens(tok.encode_continuation("blue")) == ["blue"]
    assert tok.convert_ids_to_tokens(tok.encode_continuation(" blue")) == ["\u2581blue"]
    assert tok.decode(tok.encode("The sky is blue.")) == "The sky is blue."
    clone = pickle.loads(pickle.dumps(tok))  # datasets.map(num_proc > 1) pickles it
    assert clone.encode("The sky is blue.") == tok.encode("The sky is blue.")
    with pytest.raises(ValueError, match="has no chat template; set data.chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], chat_template=resolve_chat_template("mistral")
    )
    assert text == "<s>[INST] Hi [/INST]"


def test_load_tokenizer_dispatch(tmp_path):
    model = ensure_sentencepiece_model()
    assert isinstance(load_tokenizer(str(model)), SentencePieceTokenizer)
    folder = tmp_path / "sp"
    folder.mkdir()
    shutil.copy(model, folder / "tokenizer.model")
    assert isinstance(load_tokenizer(str(folder)), SentencePieceTokenizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="no tokenizer path"):
        load_tokenizer("")


def test_a_tokenizer_that_cannot_be_loaded_is_one_line_naming_it(tmp_path, monkeypatch):
    """data.tokenizer naming a missing local path, a folder without tokenizer files, or a hub
    name that cannot be reached is one line naming it: transformers' own errors run over several
    lines and call a missing local path an invalid repo id. The hub is put offline here."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(str(tmp_path / "nope"))
    assert str(e.value) == f"tokenizer {tmp_path / 'nope'} does not exist"
    with pytest.raises(OSError) as e:
        load_tokenizer(str(tmp_path))
    assert str(e.value) == (
        f"cannot load a tokenizer from {tmp_path}: the folder holds no tokenizer.json, "
        "tokenizer_config.json or tokenizer.model"
    )
    with pytest.raises(OSError) as e:  # as the hub clients' errors are: offline advice follows
        load_tokenizer("someorg/no-such-tokenizer")
    assert str(e.value).startswith("cannot load a tokenizer from someorg/no-such-tokenizer: ")
    assert "\n" not in str(e.value)


def test_hf_sentencepiece_tokenizer_continuation_matches_wrapper(tmp_path):
    """An HF LlamaTokenizer (Metaspace, adds "▁" to every text) continues texts like the wrapper."""
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(ensure_sentencepiece_model(), folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", '
        '"unk_token": "<unk>"}'
    )
    hf = load_tokenizer(str(folder))
    sp = mistral_sp_tokenizer()
    assert prepends_space(hf) and not prepends_space(tiny_hf_tokenizer())
    for text in (" blue.", "blue.", "\n\nHi there", " It is blue, it is green."):
        assert encode_continuation(hf, text) == sp.encode_continuation(text), text
    assert hf.pad_token_id == hf.eos_token_id == 2  # no pad token: pads with EOS


def test_fingerprint_changes_with_template():
    sp = mistral_sp_tokenizer()
    other = SentencePieceTokenizer(sp.model_file, chat_template="x")
    assert tokenizer_fingerprint(sp) != tokenizer_fingerprint(other)
    assert tokenizer_fingerprint(tiny_hf_tokenizer()).startswith("hf-")
    with pytest.raises(ValueError, match="neither a built-in template"):
        resolve_chat_template("no_such_template")
