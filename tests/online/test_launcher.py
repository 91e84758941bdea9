"""scripts/iterative_dpo.sh: the shipped CPU config passes the pre-check (world size 4), and a
mistake stops the launcher with one line before any rank starts."""

from __future__ import annotations

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


def test_the_cpu_config_passes_the_pre_check(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dpo_megatron.online.run", "--check"]
        + ["--config", f"{ROOT}/configs/online_smollm2_cpu.yaml", f"run_dir={tmp_path}/run"]
        + JUDGE,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "4"  # TP 2 x PP 2 (the policy's layout)


@pytest.mark.parametrize(
    "args, line",
    [
        (
            [*JUDGE, "online.samples_per_prompt=1"],
            "config error: online.samples_per_prompt=1 must be >= 2: a pair needs a best and a "
            "worst completion",
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
