"""``python -m dpo_megatron.score``: a JSONL of text and chat rows scored with a tiny HF reward
model (one gloo rank) equals transformers' scores of the same conversations; bad rows are named
by file, line and field."""

from __future__ import annotations

import json

import pytest
import torch

from tests.data.fixtures import tiny_hf_tokenizer, write_jsonl
from tests.multirank import run_ranks

ROWS = [
    {"id": "a", "prompt": "What colour is the sky?", "completion": " It is blue."},
    {
        "id": "b",
        "prompt": [{"role": "user", "content": "Hello! How are you?"}],
        "completion": [{"role": "assistant", "content": "I am fine, thank you."}],
    },
    {"id": "c", "prompt": "Answer: yes or no.", "completion": " yes"},
]


def _reward_folder(out_dir: str, pad_token_id: int | None = None) -> str:
    """A tiny random LlamaForSequenceClassification over the fixture tokenizer, its config's
    ``pad_token_id`` the tokenizer's pad (its EOS, <|im_end|>) unless given."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tokenizer = tiny_hf_tokenizer()
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id if pad_token_id is None else pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _expected(folder: str) -> list[float]:
    """transformers' scores of the rows as whole texts: a chat row rendered by the template
    (without the newline it prints after the closing <|im_end|>), a text row as prompt +
    completion + EOS."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = tiny_hf_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    out = []
    for row in ROWS:
        if isinstance(row["prompt"], list):
            text = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
            ids = tokenizer(text.rstrip("\n"), add_special_tokens=False).input_ids
        else:
            ids = tokenizer(row["prompt"] + row["completion"]).input_ids
            ids += [tokenizer.eos_token_id]
        with torch.no_grad():
            out.append(model.eval()(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


def _run(argv):
    from dpo_megatron.cli.score import main

    main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("pad_token_id", [None, 0], ids=["tokenizer_pad", "config_pad"])
def test_score_command_writes_transformers_scores(tmp_path, pad_token_id):
    """With the config's ``pad_token_id`` the tokenizer's pad (<|im_end|>, which then is not
    scored at a row's end) and another id (<|endoftext|>: the closing <|im_end|> is scored), the
    scores are transformers', which reads the config's pad."""
    folder = _reward_folder(str(tmp_path / "rm"), pad_token_id)
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "scored.jsonl"
    argv = [
        "--input",
        str(rows),
        "--output",
        str(out),
        f"model.hf_path={folder}",
        "model.params_dtype=float32",
        "train.micro_batch_size=2",
    ]
    run_ranks(_run, world_size=1, argv=argv)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "score"} for r in written] == ROWS
    assert [r["score"] for r in written] == pytest.approx(_expected(folder), rel=1e-5)


def _score_error(rows: str, out: str, folder: str, tokenizer: str) -> str:
    """The message of the ValueError ``score_file`` raises (one rank), or ''."""
    from dpo_megatron.data import DataConfig
    from dpo_megatron.models import ModelConfig
    from dpo_megatron.parallel import ParallelConfig
    from dpo_megatron.reward.rows import score_file

    try:
        score_file(
            rows,
            out,
            model=ModelConfig(hf_path=folder, params_dtype="float32"),
            parallel=ParallelConfig(),
            data=DataConfig(tokenizer=tokenizer, chat_template="mistral"),
            micro_batch_size=2,
        )
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_a_tokenizer_past_the_reward_models_vocabulary_is_one_line(tmp_path):
    """Scoring with a tokenizer whose ids the reward model has no row for (Mistral's 32,000
    against the tiny model's few hundred) stops before any forward, naming the file and the id."""
    from tests.scripts import load_script

    folder = _reward_folder(str(tmp_path / "rm"))
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    model = str(load_script("assets").ensure_sentencepiece_model())
    (message,) = run_ranks(
        _score_error,
        world_size=1,
        rows=str(rows),
        out=str(tmp_path / "scored.jsonl"),
        folder=folder,
        tokenizer=model,
    )
    assert message.startswith(f"{rows}: token id ") and message.endswith(
        f"is past the reward model's vocabulary ({len(tiny_hf_tokenizer())} ids): score with its "
        "tokenizer (data.tokenizer, default model.hf_path's)"
    ), message
    assert not (tmp_path / "scored.jsonl").exists()


def test_bad_rows_are_named_by_file_line_and_field(tmp_path):
    from dpo_megatron.reward.rows import encode_rows, read_rows

    with pytest.raises(ValueError, match=r"--input .*missing.jsonl: no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"prompt": "x"}])
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: field 'completion' is missing"):
        read_rows(str(path))
    path = write_jsonl(tmp_path / "blank.jsonl", [ROWS[0], {"prompt": "x", "completion": " "}])
    with pytest.raises(ValueError, match=r"blank.jsonl: line 2: nothing to score"):
        encode_rows(read_rows(str(path)), str(path), tiny_hf_tokenizer(), "")
    path = write_jsonl(tmp_path / "type.jsonl", [{"prompt": 3, "completion": "y"}])
    with pytest.raises(ValueError, match=r"type.jsonl: line 1: field 'prompt'"):
        encode_rows(read_rows(str(path)), str(path), tiny_hf_tokenizer(), "")


def test_generate_rows_score_as_their_message_rows(tmp_path):
    """A row as ``python -m dpo_megatron.generate`` writes it, without ``completion_ids`` (a
    message-list prompt, the sampled text as ``completion``, its other fields), is scored as the
    row whose completion is that text as the assistant turn: the same token ids and completion
    start, so the same score; the ids are the chat template's rendering of the whole
    conversation. With its ``completion_ids`` the same row is scored on the same prompt ids
    followed by exactly those ids."""
    from dpo_megatron.reward.rows import encode_rows, read_rows

    prompt = [{"role": "user", "content": "Hello! How are you?"}]
    generated = {
        "prompt": prompt,
        "prompt_index": 0,
        "sample_index": 1,
        "completion": "I am fine, thank you.",
    }
    messages = {
        "prompt": prompt,
        "completion": [{"role": "assistant", "content": "I am fine, thank you."}],
    }
    sampled = {**generated, "completion_ids": [1, 2, 3]}
    path = write_jsonl(tmp_path / "gen.jsonl", [generated, messages, sampled])
    tokenizer = tiny_hf_tokenizer()
    scored = encode_rows(read_rows(str(path)), str(path), tokenizer, "")
    (gen_ids, msg_ids, sampled_ids), (gen_start, msg_start, sampled_start) = (
        scored.sequences,
        scored.starts,
    )
    assert gen_ids == msg_ids
    assert gen_start == msg_start
    text = tokenizer.apply_chat_template(prompt + messages["completion"], tokenize=False)
    assert gen_ids == tokenizer(text.rstrip("\n"), add_special_tokens=False).input_ids
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert gen_start == len(tokenizer(prompt_text, add_special_tokens=False).input_ids)
    assert (sampled_ids, sampled_start) == ([*gen_ids[:gen_start], 1, 2, 3], gen_start)


def test_a_reward_checkpoint_wins_over_the_base_folder():
    """``score --config <a reward run's config> model.load=<its checkpoint>`` scores with the
    checkpoint: the config's ``model.hf_path`` (the base causal LM, kept for the tokenizer) does
    not take its place, as ``model.load`` wins over ``model.hf_path`` in training."""
    from dpo_megatron.models.config import ModelConfig
    from dpo_megatron.reward.rows import reward_source

    assert reward_source(ModelConfig(hf_path="base_lm", load="rm/checkpoints")) == "rm/checkpoints"
    assert reward_source(ModelConfig(hf_path="rm_hf")) == "rm_hf"
    with pytest.raises(ValueError, match=r"set model.hf_path .* or model.load"):
        reward_source(ModelConfig())


def test_the_scoring_tokenizer_falls_back_to_the_checkpoints_source(tmp_path):
    """``data.tokenizer``, else ``model.hf_path``, else the folder a ``model.load`` checkpoint
    was built from (its stored ``hf_path``); a checkpoint that names none is one line."""
    import json as _json

    from dpo_megatron.data import DataConfig
    from dpo_megatron.models.config import ModelConfig
    from dpo_megatron.reward.rows import scoring_tokenizer

    ckpt, bare = tmp_path / "iter_0000002", tmp_path / "bare"
    for folder, stored in ((ckpt, {"hf_path": "base_lm"}), (bare, {})):
        folder.mkdir()
        (folder / "metadata.json").write_text("{}")
        (folder / "model_config.json").write_text(_json.dumps({"num_layers": 2, **stored}))
    assert scoring_tokenizer(ModelConfig(load=str(ckpt)), DataConfig(tokenizer="tok")) == "tok"
    assert scoring_tokenizer(ModelConfig(hf_path="rm", load=str(ckpt)), DataConfig()) == "rm"
    assert scoring_tokenizer(ModelConfig(load=str(ckpt)), DataConfig()) == "base_lm"
    with pytest.raises(ValueError, match=r"bare: the checkpoint names no tokenizer: set data.tok"):
        scoring_tokenizer(ModelConfig(load=str(bare)), DataConfig())
