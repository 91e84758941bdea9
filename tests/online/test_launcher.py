"""scripts/iterative_dpo.sh: the shipped CPU configs pass the pre-check, a mistake stops the
launcher with one line before any rank starts, and the judge recipe, shrunk to a tiny model, runs
end to end and writes its evaluation report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JUDGE = ["online.reward_model.path=", "online.judge=tests.online.standins:char_judge"]


def _launch(tmp_path, *args):
    return run_script(
        "scripts/iterative_dpo.sh",
        f"run_dir={tmp_path / 'run'}",
        *args,
        env={"PYTHONPATH": ROOT},
        timeout=300,
    )


@pytest.mark.parametrize(
    "config, args, world", [("online_smollm2_cpu", JUDGE, "4"), ("online_judge_cpu", [], "2")]
)
def test_the_cpu_configs_pass_the_pre_check(tmp_path, config, args, world):
    """World 4: TP 2 x PP 2 (the policy's layout); 2: DP 2."""
    out = subprocess.run(
        [sys.executable, "-m", "dpo_megatron.online.run", "--check"]
        + ["--config", f"{ROOT}/configs/{config}.yaml", f"run_dir={tmp_path}/run"]
        + args,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == world


@pytest.mark.parametrize(
    "args, line",
    [
        (
            [*JUDGE, "online.samples_per_prompt=1"],
            "config error: online.samples_per_prompt=1 must be >= 2: a pair needs a best and a "
            "worst completion (online.samples_per_prompt set on the command line)",
        ),
        (
            ["online.reward_model.path=/nonexistent/rm"],
            "config error: online.reward_model.path=/nonexistent/rm does not exist: train a "
            "reward model first (loss=bradley_terry) or score with online.judge",
        ),
    ],
)
def test_a_mistake_is_one_line_before_any_rank(tmp_path, args, line):
    out = _launch(tmp_path, *args)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == line
    assert not os.path.exists(tmp_path / "run" / "online")


def test_print_config_shows_the_online_section(tmp_path):
    out = _launch(tmp_path, *JUDGE, "online.rounds=3", "--print-config")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "online:\n  rounds: 3\n" in out.stdout


def test_a_causal_lm_as_the_reward_model_is_one_line_before_any_rank(tmp_path):
    """A causal LM given as the reward model is refused by the pre-check with one line, before
    any rank starts (not a ValueError traceback from every rank building the reward model)."""
    from tests.models.conversion_helpers import save_tiny_hf_folder

    causal = save_tiny_hf_folder("llama", str(tmp_path / "causal_lm"))
    out = _launch(tmp_path, f"online.reward_model.path={causal}")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"config error: {causal} holds a causal LM, not a reward model: train one with "
        "loss.name=bradley_terry, or give an HF *ForSequenceClassification folder"
    )
    assert not os.path.exists(tmp_path / "run" / "online")


def _tiny_model_and_prompts(tmp_path, long_prompts: int):
    """A tiny Llama folder with the tiny ChatML tokenizer, and a prompts file: 8 word-count
    prompts, then ``long_prompts`` made longer than the others by a preamble (returns the
    folder, the file and a data.max_prompt_length between the two kinds)."""
    from dpo_megatron.data.encode import encode_prompt, encode_settings
    from dpo_megatron.online.judges import word_count_prompts
    from tests.data.fixtures import tiny_hf_tokenizer
    from tests.models.conversion_helpers import build_tiny_hf_model

    tokenizer = tiny_hf_tokenizer()
    folder = str(tmp_path / "model")
    hf = build_tiny_hf_model(
        "llama", vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=1, pad_token_id=2
    )
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = word_count_prompts(8 + long_prompts, seed=5)
    for row in rows[8:]:
        row["prompt"][0]["content"] = "The sky is blue. " * 20 + row["prompt"][0]["content"]
    settings = encode_settings(tokenizer, None)
    lengths = [len(encode_prompt(r["prompt"], tokenizer, settings)) for r in rows]
    limit = max(lengths[:8])
    assert min(lengths[8:]) > limit
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, str(path), limit


def test_the_judge_recipe_shrunk_writes_its_evaluation_report(tmp_path):
    """configs/online_judge_cpu.yaml at DP 2 with a tiny model, one round of 4 prompts x 3
    samples and 2 held-out prompts: the evaluation before and after the round, its intervals
    and the KL from the starting policy in summary.json and the closing table, the plot, the
    final policy's checkpoint named last; a banner that names the rounds' checkpoint folders
    (none at the run's top); a WARNING for the 4 of 12 prompts left out for length."""
    model, prompts, limit = _tiny_model_and_prompts(tmp_path, long_prompts=4)
    run = tmp_path / "run"
    out = run_script(
        "scripts/iterative_dpo.sh",
        "--config",
        "configs/online_judge_cpu.yaml",
        f"run_dir={run}",
        f"model.hf_path={model}",
        f"online.prompts={prompts}",
        f"data.max_prompt_length={limit}",
        f"data.max_length={limit + 6}",
        "online.rounds=1",
        "online.prompts_per_round=4",
        "online.eval_prompts=2",
        "online.samples_per_prompt=3",
        "online.sampling.max_new_tokens=6",
        "train.train_iters=2",
        "train.global_batch_size=2",
        "train.lr=1e-2",
        "checkpoint.save_interval=2",
        env={"PYTHONPATH": ROOT},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        f"run_dir {run} | checkpoints -> {run}/online/round_<r>/checkpoints |"
    )
    assert not os.path.exists(run / "checkpoints")
    assert (
        f"WARNING: 4 of 12 prompts (33%) were left out: longer than data.max_prompt_length={limit}"
        " tokens (raise data.max_prompt_length, or pick other rows with online.prompts_offset / "
        "online.prompts_limit)"
    ) in lines
    final = f"{run}/online/round_0/checkpoints/iter_0000002"
    assert lines[-1] == (
        f"online: final policy {final} (continue: model.load={final}; as an HF folder: "
        f"scripts/convert_megatron_to_hf.py --load {final} --save OUT) | summary "
        f"{run}/online/summary.json | plot {run}/online/evaluation.png"
    )
    table = lines.index(
        "online: held-out evaluation (2 prompts x 3 samples, scorer "
        "dpo_megatron.online.judges:word_count; mean [95% bootstrap interval]):"
    )
    assert lines[table + 1].startswith("  start     score ")
    assert lines[table + 2].startswith("  round 0   score ") and " KL " in lines[table + 2]
    report = json.loads((run / "online" / "summary.json").read_text())
    assert report["final_policy"] == final
    start, after = report["evaluation"]
    rows = [json.loads(x) for x in (run / "online/round_0/eval.jsonl").read_text().splitlines()]
    start_rows = [json.loads(x) for x in (run / "online/eval_start.jsonl").read_text().splitlines()]
    mean = sum(r["score"] for r in rows) / 6
    assert after["score"]["mean"] == pytest.approx(mean)
    assert after["score_change"]["mean"] == pytest.approx(
        mean - sum(r["score"] for r in start_rows) / 6
    )
    assert start["kl_from_initial"] == {"mean": 0.0, "low": 0.0, "high": 0.0}
    ratios = [r["logp"] - r["logp_initial"] for r in rows]
    assert after["kl_from_initial"]["mean"] == pytest.approx(sum(ratios) / 6)
    for e in (start, after):
        for key in ("score", "kl_from_initial"):
            assert e[key]["low"] <= e[key]["mean"] <= e[key]["high"]
    assert (run / "online" / "evaluation.png").read_bytes()[:4] == b"\x89PNG"
    assert report["rounds"][0]["wall_s"]["train"] > 0 and report["wall_s"]["eval_start"] > 0
