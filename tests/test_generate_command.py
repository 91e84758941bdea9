"""``python -m dpo_megatron.generate`` end to end on a tiny Llama with the tiny BPE tokenizer:
text and chat prompts through the chat template (a text as one user turn, unless turned off),
greedy completions equal to ``transformers``' ``generate`` (stopping at EOS, which is kept), rows
in input order with their decoded text, and a malformed prompt row refused in one line naming
file, line and field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.data.fixtures import tiny_hf_tokenizer
from tests.models.conversion_helpers import build_tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    {"prompt": "the cat sat on the"},
    {"messages": [{"role": "user", "content": "where is the dog?"}]},
    {"prompt": "a", "id": 7},
]
MAX_NEW = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder with weights and tokenizer, the transformers model, the tokenizer)."""
    folder = tmp_path_factory.mktemp("generate_command") / "model"
    tokenizer = tiny_hf_tokenizer()
    hf = build_tiny_hf_model(
        "llama", vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=1, pad_token_id=2
    )
    hf.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder), hf, tokenizer


def _command(tmp_path, model_dir, prompts, *overrides):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    config = tmp_path / "generate.yaml"
    config.write_text(
        f"run_dir: {tmp_path}/run\n"
        f"model:\n  hf_path: {model_dir}\n  params_dtype: float32\n  transformer_impl: local\n"
        f"generation:\n  prompts: {prompts_file}\n  temperature: 0\n"
        f"  max_new_tokens: {MAX_NEW}\n  num_samples: 2\n  micro_batch_size: 2\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "dpo_megatron.generate", "--config", str(config), *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


@pytest.mark.slow
def test_generate_command_writes_greedy_completions_of_text_and_chat_prompts(tmp_path, model):
    model_dir, hf, tokenizer = model
    out_file = tmp_path / "out" / "completions.jsonl"
    done = _command(tmp_path, model_dir, PROMPTS, f"generation.output={out_file}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [
        (i, j) for i in range(3) for j in range(2)
    ]

    def rendered(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    # the tokenizer has a chat template: a text prompt is one user turn through it
    prompt_ids = [
        rendered([{"role": "user", "content": PROMPTS[0]["prompt"]}]),
        rendered(PROMPTS[1]["messages"]),
        rendered([{"role": "user", "content": "a"}]),
    ]
    for i, ids in enumerate(prompt_ids):
        x = torch.tensor([ids])
        expected = hf.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW
        )[0, len(ids) :].tolist()
        for row in rows[2 * i : 2 * i + 2]:
            assert row["completion_ids"] == expected, i
            assert row["completion"] == tokenizer.decode(expected, skip_special_tokens=True)
    # each row's prompt is the form sampled after: the text as the user turn it was sent as
    assert rows[0]["prompt"] == [{"role": "user", "content": PROMPTS[0]["prompt"]}]
    assert rows[2]["prompt"] == PROMPTS[1]["messages"]
    assert "completions of 3 prompts" in done.stdout
    assert f"[generate] layout TP 1 x PP 1 x DP 1 | weights: Hugging Face folder {model_dir}\n" in (
        done.stdout
    )
    assert (
        "[generate] 2 text prompt(s) sent as one user turn through the chat template "
        "(generation.apply_chat_template=false: as they stand)\n"
    ) in done.stdout


def test_text_prompts_take_the_chat_template_unless_turned_off():
    """An instruct model given a bare text ends at once: a text prompt goes through the chat
    template as one user turn when there is one (and is kept in that form for the output rows);
    generation.apply_chat_template=false, or a tokenizer without a template, sends the text as
    it stands (and says nothing)."""
    import copy

    from dpo_megatron.data.encode import encode_settings
    from dpo_megatron.generation.files import encode_prompts

    tokenizer = tiny_hf_tokenizer()
    settings = encode_settings(tokenizer, None)
    text, chat = "the cat sat on the", [{"role": "user", "content": "where is the dog?"}]
    as_chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    assert as_chat.startswith("<|im_start|>user\nthe cat sat")
    plain = tokenizer.encode(text, add_special_tokens=False)
    encoded = encode_prompts([text, chat], tokenizer, settings)
    ids = encoded.prompt_ids
    assert ids[0] == tokenizer.encode(as_chat, add_special_tokens=False)
    assert encoded.prompts == [[{"role": "user", "content": text}], chat]
    assert encoded.note.startswith("[generate] 1 text prompt(s) sent as one user turn")
    off = encode_prompts([text, chat], tokenizer, settings, False)
    assert (off.prompts, off.prompt_ids, off.note) == ([text, chat], [plain, ids[1]], None)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    alone = encode_prompts([text], bare, encode_settings(bare, None))
    assert (alone.prompts, alone.prompt_ids, alone.note) == ([text], [plain], None)


def test_the_start_up_line_names_the_layout_and_the_weights_sampled_from():
    """The command said neither which weights it sampled from (a training config's
    model.hf_path, or the checkpoint model.load names) nor the layout; a run's start-up line
    names both, in the same words."""
    from dpo_megatron.cli.generate import start_line
    from dpo_megatron.config import load_config

    overrides = ["model.hf_path=/models/hf", "parallel.pipeline_model_parallel_size=2"]
    cfg = load_config(None, overrides, check=False)
    assert start_line(cfg, cfg.model, 3) == (
        "[generate] layout TP 1 x PP 2 x DP 3 | weights: Hugging Face folder /models/hf"
    )


def test_generate_command_names_a_malformed_prompt_row(tmp_path):
    """Refused before torch is imported (about a second)."""
    done = _command(tmp_path, str(tmp_path / "no_model"), [{"prompt": "a"}, {"text": "b"}])
    assert done.returncode == 2  # USER_ERROR_EXIT
    assert "prompts.jsonl: line 2: field 'prompt'" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
