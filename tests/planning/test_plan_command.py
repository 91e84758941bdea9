"""``python -m dpo_megatron.plan`` and ``scripts/pretrain_dpo.sh --plan``: the ranked table, the
JSON records, every layout it offers accepted by the launcher's pre-check, its mistakes in one
line, and the pre-check's memory warning."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from dpo_megatron.config import check_data, check_model_layout, load_config, validate
from dpo_megatron.planning.hardware import ACCELERATORS, Cluster
from tests.scripts import ROOT, launcher_env, run_script

TINY = "configs/tiny_cpu.yaml"
CLUSTER = ["--gpu", "h100", "--nodes", "1", "--gpus-per-node", "4"]
RECORD = {"tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch_size", "status", "fits", "reason"}
BYTES = {"weights", "grads", "optimizer", "reference", "activations", "logits", "total"}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    from dpo_megatron.cli.plan import run

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    document = run(["--config", TINY, *CLUSTER, "--json", str(out)])
    return document, json.loads(out.read_text())


def test_json_has_one_record_per_layout_with_its_bytes_and_time(planned):
    document, written = planned
    assert written == json.loads(json.dumps(document))
    layouts = written["layouts"]
    assert len(layouts) >= 20
    for record in layouts:
        assert RECORD <= set(record)
        assert record["tp"] * record["pp"] * record["cp"] * record["dp"] == 4
        if record["status"] != "refused":
            assert set(record["bytes"]) == BYTES | {"workspace"}
            assert record["params_per_rank"] > 0 and record["step_time_s"] > 0
            assert record["fits"] == (record["reason"] == "") == (record["status"] != "no")
            assert record["tokens_per_s_per_gpu"] * 4 == pytest.approx(record["tokens_per_s"])
        else:
            assert not record["fits"] and record["reason"]  # refused, with the rule's words
    fits = [r["fits"] for r in layouts]
    assert fits == sorted(fits, reverse=True)  # every fitting layout before the others
    assert written["best"] == layouts[0] and written["config_layout"]["status"] == "yes"
    first = [r for r in layouts if r["fits"] and not r["tight"]]
    times = [r["step_time_s"] for r in first]
    assert times[0] <= 1.02 * min(times)  # ranked fastest first (2% counts as equal)


def test_every_offered_layout_passes_the_pre_check(planned):
    """Each fitting record's overrides, given to the config as a user would, pass the
    launcher's checks: the config rules, the data, the model against the layout."""
    _, written = planned
    offered = [r for r in written["layouts"] if r["fits"]]
    assert len(offered) >= 10
    for record in offered:
        cfg = load_config(TINY, record["overrides"])
        validate(cfg)
        check_data(cfg)
        check_model_layout(cfg)
        assert cfg.parallel.launch_world_size() == 4


def test_the_launcher_plans_and_the_pre_check_accepts_the_best(planned, tmp_path):
    _, written = planned
    best = written["layouts"][0]
    planned_run = run_script(
        "scripts/pretrain_dpo.sh", "--plan", "--config", TINY, *CLUSTER, "--top", "3"
    )
    assert planned_run.returncode == 0, planned_run.stderr
    assert "best: " in planned_run.stdout and "parallel:" in planned_run.stdout
    # the launcher's own pre-check (python -m dpo_megatron.config) on the best layout
    checked = subprocess.run(
        [sys.executable, "-m", "dpo_megatron.config", "--config", TINY, *best["overrides"]]
        + [f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines()[-1] == "4"  # the world size it asks torchrun for


def test_a_mistake_is_one_config_error_line_and_a_misfit_exit_2():
    from dpo_megatron.cli.plan import main

    with pytest.raises(SystemExit, match=r"^config error: --gpu 'v100' is not in the table"):
        main(["--config", TINY, "--gpu", "v100"])
    with pytest.raises(SystemExit, match=r"^config error: unknown config key 'train.nope'"):
        main(["--config", TINY, "train.nope=1"])
    with pytest.raises(SystemExit, match=r"^config error: --nodes=0 must be >= 1"):
        main(["--config", TINY, "--nodes", "0"])
    with pytest.raises(SystemExit, match=r"^config error: --mfu=1.5 must be in \(0, 1\]"):
        main(["--config", TINY, "--mfu", "1.5"])
    # the config's layout pinned to 2 ranks on a cluster of 4: refused as the ranks would
    with pytest.raises(SystemExit) as refused:
        main(["--config", TINY, *CLUSTER, "--layout", "parallel.data_parallel_size=2"])
    assert refused.value.code == 2
    main(["--config", TINY, *CLUSTER, "--layout"])  # fits: returns


def test_without_a_config_the_mistake_says_to_pass_one():
    """A bare ``python -m dpo_megatron.plan`` (the defaults name no data) ends with the
    config's mistake and how to give the planner a run: ``--config FILE``, naming a recipe
    that exists; with ``--config`` the same mistake is the config's alone."""
    import os

    from dpo_megatron.cli.plan import RECIPE, main

    assert os.path.isfile(os.path.join(ROOT, RECIPE))
    with pytest.raises(SystemExit) as stop:
        main([])
    assert str(stop.value) == (
        "config error: no data: set data.path (one dataset) or data.datasets (a mix) (no "
        "--config given: the planner plans a run's config; pass --config FILE, e.g. "
        f"{RECIPE} or another recipe of configs/gpu/)"
    )
    with pytest.raises(
        SystemExit,
        match=r"^config error: no data: set data.path .*a mix\) "
        r"\(data.path set on the command line\)$",
    ):
        main(["--config", TINY, "data.path="])


def test_the_pre_check_warns_when_the_layout_does_not_fit():
    from dpo_megatron.config import predicted_memory_warning

    cfg = load_config(TINY, ["parallel.data_parallel_size=1"])
    assert predicted_memory_warning(cfg, Cluster(1, 1, ACCELERATORS["h100"])) is None
    small = dataclasses.replace(ACCELERATORS["h100"], memory_gib=3.01)
    warning = predicted_memory_warning(cfg, Cluster(1, 1, small))
    assert warning.startswith("WARNING: the layout planner predicts ")
    assert "at most 0.0 GiB predicted fits a 3.01 GiB H100 SXM" in warning
    assert "scripts/pretrain_dpo.sh --plan" in warning
