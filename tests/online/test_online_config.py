"""The online section's errors, and the prompts file read as the rounds read it."""

from __future__ import annotations

import json
import os

import pytest

from dpo_megatron.config import load_config, validate_online_config
from dpo_megatron.online.prompts import encode_prompts, read_prompts, round_prompts, split_prompts
from tests.data.fixtures import tiny_hf_tokenizer


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "The sky is blue."},
        {
            "messages": [
                {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "x"},
            ]
        },
        {"prompt": [{"role": "user", "content": "What colour is the sky?"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, prompts_file, *overrides):
    base = [
        f"run_dir={tmp_path / 'run'}",
        "model.load=/some/checkpoint",
        "data.tokenizer=/some/tokenizer",
        "online.rounds=2",
        f"online.prompts={prompts_file}",
        "online.judge=tests.online.standins:char_judge",
    ]
    return load_config(None, [*base, *overrides], check=False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["online.samples_per_prompt=1"], "online.samples_per_prompt=1 must be >= 2"),
        (["online.prompts="], "online.prompts is empty"),
        (["online.judge="], "set exactly one scorer: online.judge"),
        (["online.reward_model.path=/rm"], "set exactly one scorer"),
        (["online.judge=not a callable"], "must name a callable as package.module:function"),
        (["online.reference=final"], "online.reference='final'; expected one of"),
        (["online.sampling.temperature=0"], "online.sampling.temperature=0.0 must be > 0"),
        (["online.sampling.top_p=1.5"], "online.sampling.top_p=1.5 must be"),
        (["online.min_margin=-1"], "online.min_margin=-1.0 must be >= 0"),
        (["online.rounds=0"], "online.rounds=0: an online run needs online.rounds >= 1"),
        (["model.load="], "start it from pretrained weights"),
        (["lora.enabled=true"], "lora.enabled=true is not supported by online runs"),
        (
            ["reference.hf_path=/sft"],
            "reference.hf_path=/sft: an online run's reference is online.reference",
        ),
        (["checkpoint.resume=/x"], "an online run resumes with checkpoint.resume=auto"),
        (["checkpoint.save=/x"], "leave checkpoint.save empty"),
        (
            [
                "online.judge=",
                "online.reward_model.path=/rm",
                "online.reward_model.parallel.tensor_model_parallel_size=0",
            ],
            "online.reward_model.parallel.tensor_model_parallel_size=0 must be >= 1",
        ),
    ],
)
def test_config_errors_name_the_field(tmp_path, prompts_file, overrides, message):
    cfg = _cfg(tmp_path, prompts_file, *overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate_online_config(cfg)


def test_reward_model_layout_must_fit_the_world(tmp_path, prompts_file):
    cfg = _cfg(
        tmp_path,
        prompts_file,
        "online.judge=",
        "online.reward_model.path=/rm",
        "online.reward_model.parallel.tensor_model_parallel_size=4",
    )
    validate_online_config(cfg)  # no world size yet
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by online\.reward_model"):
        validate_online_config(cfg, world_size=2)


def test_the_sampling_layout_takes_its_own_sizes_and_must_fit_the_world(tmp_path, prompts_file):
    """``online.sampling.parallel``: 0 keeps the policy's size; a size set replaces it, DP takes
    the rest, a new pipeline size drops the interleaving and TP 1 sequence parallelism."""
    from dpo_megatron.online.layouts import sampling_layout
    from dpo_megatron.parallel import ParallelConfig

    cfg = _cfg(tmp_path, prompts_file)
    assert sampling_layout(cfg) is cfg.parallel  # nothing set: the policy's layout itself
    policy = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        data_parallel_size=1,
        sequence_parallel=True,
    )
    layout = type(cfg.online.sampling.parallel)
    same = layout(tensor_model_parallel_size=2).resolve(policy)
    assert same is policy
    tp1 = layout(tensor_model_parallel_size=1).resolve(policy)
    assert (tp1.tensor_model_parallel_size, tp1.pipeline_model_parallel_size) == (1, 2)
    assert tp1.virtual_pipeline_model_parallel_size == 2 and not tp1.sequence_parallel
    assert tp1.data_parallel_size is None
    pp1 = layout(pipeline_model_parallel_size=1).resolve(policy)
    assert (pp1.tensor_model_parallel_size, pp1.pipeline_model_parallel_size) == (2, 1)
    assert pp1.virtual_pipeline_model_parallel_size is None and pp1.sequence_parallel

    cfg = _cfg(tmp_path, prompts_file, "online.sampling.parallel.tensor_model_parallel_size=4")
    validate_online_config(cfg)  # no world size yet
    validate_online_config(cfg, world_size=4)
    with pytest.raises(
        ValueError, match=r"world size 2 is not divisible by online\.sampling\."
    ) as e:
        validate_online_config(cfg, world_size=2)
    # the size it sets by its own key; the sizes it keeps (PP left at 0) and the one it has
    # no key for (CP) by parallel.*'s
    assert "online.sampling.parallel.tensor_model_parallel_size (4)" in str(e.value)
    assert "x parallel.pipeline_model_parallel_size (1)" in str(e.value)
    assert "x parallel.context_parallel_size (1) = 4" in str(e.value)
    assert "online.sampling.parallel.context_parallel_size" not in str(e.value)
    cfg = _cfg(tmp_path, prompts_file, "online.sampling.parallel.pipeline_model_parallel_size=-1")
    with pytest.raises(
        ValueError,
        match=r"online\.sampling\.parallel\.pipeline_model_parallel_size=-1 must be >= 0",
    ):
        validate_online_config(cfg)


def test_the_start_up_line_names_a_sampling_layout_of_its_own(tmp_path, prompts_file, monkeypatch):
    from dpo_megatron.online import rounds

    monkeypatch.setattr(rounds.ranks, "world_size", lambda: 4)
    cfg = _cfg(tmp_path, prompts_file, "parallel.tensor_model_parallel_size=2")
    assert rounds._sampling_note(cfg) == ""  # samples at the policy's layout
    cfg = _cfg(
        tmp_path,
        prompts_file,
        "parallel.tensor_model_parallel_size=2",
        "online.sampling.parallel.tensor_model_parallel_size=1",
    )
    assert rounds._sampling_note(cfg) == " | sampling at TP 1 x PP 1 x DP 4"


def test_a_valid_section_passes_and_changes_nothing(tmp_path, prompts_file):
    """A valid online config passes; checked frozen (``utils.frozen``), nothing in it changes:
    the loss alias was replaced when it was loaded, and the prompts file stands in for
    ``data.path`` only in a copy the data checks read."""
    from dpo_megatron.utils.frozen import freeze, thaw

    cfg = freeze(_cfg(tmp_path, prompts_file, "loss=dpo"))
    before = thaw(cfg)
    validate_online_config(cfg)
    assert cfg == before and cfg.loss["name"] == "sigmoid" and not cfg.data.path


def test_prompts_from_every_row_form_and_rounds_wrap(tmp_path, prompts_file):
    rows = read_prompts(str(prompts_file), offset=1)
    assert [r for r, _ in rows] == [1, 2]
    assert rows[0][1] == [{"role": "user", "content": "Hello!"}]  # the assistant turn dropped
    tok = tiny_hf_tokenizer()
    items, too_long = encode_prompts(read_prompts(str(prompts_file)), tok)
    assert too_long == 0 and [it.row for it in items] == [0, 1, 2]
    assert items[0].prompt_ids == tuple(tok.encode("The sky is blue.", add_special_tokens=False))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], tokenize=False, add_generation_prompt=True
    )
    assert items[1].prompt_ids == tuple(tok.encode(chat, add_special_tokens=False))
    short, dropped = encode_prompts(read_prompts(str(prompts_file)), tok, max_prompt_length=6)
    assert dropped == 3 - len(short) and dropped >= 1
    # file order, 2 per round over 3 prompts: round 1 wraps around
    assert [it.row for it in round_prompts(items, 1, 2, False, 0)] == [2, 0]
    shuffled = [it.row for r in range(3) for it in round_prompts(items, r, 1, True, 5)]
    assert sorted(shuffled) == [0, 1, 2]  # one pass over a seeded permutation
    pool, held = split_prompts(items, 1, True, 5)
    assert [it.row for it in held + pool] == shuffled  # the first of the same order held out
    from dpo_megatron.data.sources import DataError

    with pytest.raises(DataError, match="online.eval_prompts=3 holds out every one of the 3"):
        split_prompts(items, 3, True, 5)


def test_prompts_of_a_preference_format_and_errors(tmp_path):
    path = tmp_path / "pairs.json"
    row = {
        "conversations": [{"from": "human", "value": "Name a colour."}],
        "chosen": {"from": "gpt", "value": "Blue."},
        "rejected": {"from": "gpt", "value": "No."},
    }
    path.write_text(json.dumps([row, row]))
    rows = read_prompts(str(path), limit=1)
    assert rows == [(0, [{"role": "user", "content": "Name a colour."}])]
    from dpo_megatron.data.sources import DataError

    with pytest.raises(DataError, match="no rows left after online.prompts_offset=5"):
        read_prompts(str(path), offset=5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match="rows need a 'prompt' or 'messages' field"):
        read_prompts(str(bad))


def test_a_fresh_run_over_an_online_run_is_refused(tmp_path, prompts_file):
    from dpo_megatron.training.run_dir import RunDirError, check_run_dir
    from dpo_megatron.utils.run_layout import RunLayout

    cfg = _cfg(tmp_path, prompts_file)
    check_run_dir(cfg)  # an empty folder: fine
    state = RunLayout(cfg.run_dir).online_state
    os.makedirs(os.path.dirname(state))
    with open(state, "w") as f:
        f.write('{"rounds": {}}')
    with pytest.raises(RunDirError, match=r"already holds a run \(an online run \(.*state\.json"):
        check_run_dir(cfg)
    cfg.checkpoint.resume = "auto"
    check_run_dir(cfg)  # continuing it is fine


def test_errors_say_which_file_set_the_keys_they_name(tmp_path, prompts_file):
    """An online config has no ``data.path``: its checks read a copy with the prompts file in
    its place, and both the training rules on that copy and the online ones name the file (or
    the command line) that set each key, as a training run's do."""
    online = tmp_path / "online.yaml"
    online.write_text("online:\n  rounds: 2\n  samples_per_prompt: 1\n")
    batches = tmp_path / "batches.yaml"
    batches.write_text("train:\n  global_batch_size: 3\n  micro_batch_size: 2\n")
    base = [
        f"run_dir={tmp_path / 'run'}",
        "model.load=/some/checkpoint",
        "data.tokenizer=/some/tokenizer",
        f"online.prompts={prompts_file}",
        "online.judge=tests.online.standins:char_judge",
    ]
    cfg = load_config([str(online)], base, check=False)
    with pytest.raises(ValueError) as error:
        validate_online_config(cfg)
    assert str(error.value).endswith(f"(online.samples_per_prompt set in {online})")
    cfg = load_config([str(batches)], [*base, "online.rounds=2"], check=False)
    with pytest.raises(ValueError) as error:
        validate_online_config(cfg)
    assert str(error.value).endswith(
        f"(train.global_batch_size set in {batches}, train.micro_batch_size set in {batches})"
    )


def test_the_sampling_layout_is_checked_against_the_model(tmp_path, prompts_file):
    """A sampling pipeline that does not split the model's layers stops in the pre-check,
    named after ``online.sampling.parallel``, as a training one does after ``parallel.*``."""
    from dpo_megatron.cli.online import check_sampling_model_layout

    def cfg(*overrides):
        return load_config(
            None,
            [f"run_dir={tmp_path / 'run'}", "model.num_layers=6", *overrides],
            check=False,
        )

    check_sampling_model_layout(cfg())  # no sampling layout of its own
    check_sampling_model_layout(cfg("online.sampling.parallel.pipeline_model_parallel_size=3"))
    with pytest.raises(
        ValueError,
        match=r"^model has 6 layers, not divisible by "
        r"online\.sampling\.parallel\.pipeline_model_parallel_size=4 x virtual stages 1$",
    ):
        check_sampling_model_layout(cfg("online.sampling.parallel.pipeline_model_parallel_size=4"))
