"""The GPU recipes (``configs/gpu/``): each passes the launcher's pre-check offline
(``--without-weights``: architecture from its preset, no weights), its layout is the one the
planner picks for the cluster its header names, and the header's predicted memory and step time
are the planner's (so they cannot drift from the planner)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dpo_megatron.config import check_data, check_model_layout, load_config, validate

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))
LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "micro_batch_size", "recompute")


def _header(path: Path) -> tuple[list[str], float, float]:
    """(the planner's cluster options, predicted GiB, predicted seconds) from the header."""
    text = path.read_text()
    command = re.search(r"^#\s+python -m dpo_megatron\.plan --config (\S+) (.*)$", text, re.M)
    assert command and command.group(1) == f"configs/gpu/{path.name}", path.name
    predicted = re.search(r"^# predicted: ([\d.]+) GiB per GPU, ([\d.]+) s per step$", text, re.M)
    assert predicted, path.name
    return shlex.split(command.group(2)), float(predicted.group(1)), float(predicted.group(2))


def test_the_five_recipes_are_there():
    assert {p.stem for p in RECIPES} == {
        "llama3.1_8b_h100",
        "qwen3_8b_h100",
        "qwen3_30b_a3b_h200",
        "llama3.3_70b_h100_4nodes",
        "gpt_oss_20b_h100",
    }


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_passes_the_pre_check_offline(recipe, monkeypatch):
    monkeypatch.delenv("DPO_MEGATRON_MODELS", raising=False)
    cfg = load_config(str(recipe))
    validate(cfg)
    check_data(cfg)  # hub datasets: read by the ranks, nothing to check here
    check_model_layout(cfg)
    assert cfg.model.hf_path.count("/") == 1 and not Path(cfg.model.hf_path).exists()


def test_the_pre_check_command_passes_a_recipe_without_its_weights(tmp_path):
    """The launcher's pre-check itself: ``--without-weights`` passes the 70B recipe (32 ranks);
    without the flag the missing weights are named, with the download to make."""
    import subprocess
    import sys

    from tests.scripts import launcher_env

    recipe = "configs/gpu/llama3.3_70b_h100_4nodes.yaml"
    env = {k: v for k, v in launcher_env().items() if k != "DPO_MEGATRON_MODELS"}
    command = [sys.executable, "-m", "dpo_megatron.config", "--config", recipe]
    command += [f"run_dir={tmp_path / 'run'}"]
    ok = subprocess.run(
        [*command, "--without-weights"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "32"
    refused = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert refused.returncode == 1
    assert "looks like a hub name: download it (hf download meta-llama/Llama-3.3-70B" in (
        refused.stderr
    )


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_is_the_planners_pick_with_its_prediction(recipe, monkeypatch, capsys):
    from dpo_megatron.cli.plan import run

    monkeypatch.delenv("DPO_MEGATRON_MODELS", raising=False)
    cluster, gib, seconds = _header(recipe)
    document = run(["--config", str(recipe), *cluster])
    mine, best = document["config_layout"], document["layouts"][0]
    assert mine["fits"] and not mine["tight"]
    assert round(mine["bytes"]["total"] / 2**30, 1) == gib
    assert round(mine["step_time_s"], 2) == seconds
    assert {k: best[k] for k in LAYOUT_KEYS} == {k: mine[k] for k in LAYOUT_KEYS}
    assert "best: " in capsys.readouterr().out
