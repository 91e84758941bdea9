"""How the online loop's reward model reads the policy's samples (``adapters.reward_reader``,
``adapters.reward_model_sequences``): a reward model trained here (a checkpoint, no tokenizer
of its own) and an HF folder holding the policy's tokenizer read the sampled ids as they are; a
reward model with another family's tokenizer and chat template reads each sample's prompt form
and completion text encoded with its own tokenizer, as ``python -m dpo_megatron.score`` reads
such rows. No model: the samples are fixed ids."""

from __future__ import annotations

import pytest

from dpo_megatron.online.adapters import reward_model_sequences, reward_reader
from dpo_megatron.online.prompts import encode_prompts
from dpo_megatron.online.records import SampleRecord
from tests.data.fixtures import mistral_sp_tokenizer, tiny_hf_tokenizer

FORMS = ["The sky is blue.", [{"role": "user", "content": "What colour is the sky?"}]]
COMPLETIONS = ["It is.", "Blue, mostly."]


def _config(**reward_model):
    from dpo_megatron.config import config_from_mapping

    return config_from_mapping(
        {"model": {"load": "initial"}, "online": {"rounds": 1, "reward_model": reward_model}},
        check=False,
    )


def _samples(policy):
    """Two samples of each prompt form: a completion ending in EOS and one that stopped at
    once (EOS alone, blank text)."""
    items, _ = encode_prompts(list(enumerate(FORMS)), policy)
    eos = policy.eos_token_id
    samples = []
    for i, (item, text) in enumerate(zip(items, COMPLETIONS)):
        for k, ids in enumerate(([*policy.encode(text, add_special_tokens=False), eos], [eos])):
            samples.append(
                SampleRecord(
                    round=0,
                    prompt=i,
                    sample=k,
                    row=i,
                    prompt_text=policy.decode(list(item.prompt_ids)),
                    completion_text=policy.decode(ids, skip_special_tokens=True),
                    prompt_ids=item.prompt_ids,
                    completion_ids=tuple(ids),
                )
            )
    return [FORMS[s.prompt] for s in samples], samples


def test_the_policys_tokenizer_reads_the_sampled_ids(tmp_path):
    """A checkpoint (no tokenizer files): the policy's tokenizer and pad; an HF folder with the
    policy's tokenizer saved in it: that one, loaded, and its config's pad id. Both read every
    sample as it was sampled."""
    policy = tiny_hf_tokenizer()
    forms, samples = _samples(policy)
    (tmp_path / "ckpt").mkdir()
    policy.save_pretrained(str(tmp_path / "hf_rm"))
    (tmp_path / "hf_rm" / "config.json").write_text('{"pad_token_id": 0}')
    cases = ((tmp_path / "ckpt", "", 2), (tmp_path / "hf_rm", str(tmp_path / "hf_rm"), 0))
    for path, source, pad_id in cases:
        reader = reward_reader(_config(path=str(path)), policy)
        assert (reader.source, reader.pad_id) == (source, pad_id)
        assert (reader.tokenizer is policy) == (source == "")
        encoded = reward_model_sequences(reader, forms, samples, "samples.jsonl")
        assert encoded.retokenized == 0
        assert encoded.sequences == [s.sequence for s in samples]
        assert encoded.starts == [len(s.prompt_ids) for s in samples]


def test_another_familys_tokenizer_reads_the_text(tmp_path, capsys):
    """``online.reward_model.tokenizer`` (Mistral's SentencePiece) with
    ``online.reward_model.chat_template=mistral``: each sample is its prompt form and completion
    text in that tokenizer (the text prompt as it stands, the messages through the mistral
    template, the completion ending in its EOS); a completion that stopped at once is its EOS
    alone; rank 0 says how many were read from their text."""
    from dpo_megatron.data.encode import encode_prompt, encode_settings
    from dpo_megatron.data.tokenizer import resolve_chat_template
    from tests.scripts import load_script

    policy = tiny_hf_tokenizer()
    forms, samples = _samples(policy)
    model = str(load_script("assets").ensure_sentencepiece_model())
    cfg = _config(path=str(tmp_path), tokenizer=model, chat_template="mistral")
    reader = reward_reader(cfg, policy)
    assert reader.source == model and reader.chat_template == "mistral"
    encoded = reward_model_sequences(reader, forms, samples, "samples.jsonl")

    theirs = mistral_sp_tokenizer()
    settings = encode_settings(theirs, resolve_chat_template("mistral"))
    assert encoded.retokenized == len(samples) == 4
    for s, form, sequence, start in zip(samples, forms, encoded.sequences, encoded.starts):
        prompt = encode_prompt(form, theirs, settings)
        assert prompt[0] == theirs.bos_token_id and sequence[:start] == prompt
        completion = sequence[start:]
        assert completion[-1] == theirs.eos_token_id
        if s.sample == 1:
            assert completion == [theirs.eos_token_id]
        else:
            assert (
                theirs.decode(completion, skip_special_tokens=True).strip() == COMPLETIONS[s.prompt]
            )
    assert "[online, round 0] 4 of 4 sampled completions read from their text" in (
        capsys.readouterr().out
    )


def test_a_reward_tokenizer_without_a_chat_template_is_refused_for_chat_prompts(tmp_path):
    """Mistral's SentencePiece has no template of its own: with chat prompts the run is refused
    before any round, naming the key to set; text prompts, or the template set, pass."""
    from dpo_megatron.online.adapters import check_reward_reader
    from tests.scripts import load_script

    model = str(load_script("assets").ensure_sentencepiece_model())
    bare = reward_reader(_config(path=str(tmp_path), tokenizer=model), tiny_hf_tokenizer())
    with pytest.raises(ValueError, match=r"set online.reward_model.chat_template \(chatml"):
        check_reward_reader(bare, FORMS)
    check_reward_reader(bare, [FORMS[0]])
    cfg = _config(path=str(tmp_path), tokenizer=model, chat_template="mistral")
    check_reward_reader(reward_reader(cfg, tiny_hf_tokenizer()), FORMS)


def test_a_bad_reward_model_chat_template_is_a_config_error():
    """Named by its own key, before any model is built."""
    from dpo_megatron.online.checks import validate_online

    cfg = _config(path="rm", chat_template="nonexistent.jinja")
    with pytest.raises(ValueError, match=r"online.reward_model.chat_template='nonexistent.jinja'"):
        validate_online(cfg)


def test_a_checkpoint_reads_with_the_tokenizer_it_was_built_from(tmp_path):
    """A reward-model checkpoint trained here names the folder it was built from (its stored
    ``model.hf_path``): with another vocabulary than the policy's, that folder's tokenizer and
    its own chat template read the samples (scoring the policy's ids would read them as other
    tokens); with the policy's vocabulary, the policy's tokenizer reads them, as before."""
    import json

    from transformers import AutoTokenizer

    policy = tiny_hf_tokenizer()
    same, other = tmp_path / "same", tmp_path / "other"
    policy.save_pretrained(str(same))
    widened = AutoTokenizer.from_pretrained(str(same))
    widened.add_tokens(["<|tool|>"])
    widened.save_pretrained(str(other))
    for base, source in ((same, ""), (other, str(other))):
        ckpt = tmp_path / f"ckpt_{base.name}"
        ckpt.mkdir()
        (ckpt / "model_config.json").write_text(json.dumps({"hf_path": str(base)}))
        reader = reward_reader(_config(path=str(ckpt)), policy)
        assert reader.source == source
        assert (reader.tokenizer is policy) == (source == "")
        assert reader.chat_template == ("" if source else _config().data.chat_template)
        assert len(reader.tokenizer) == len(policy) + (source != "")
