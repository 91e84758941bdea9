"""scripts/gpu_check.sh: the GPU check's whole flow, rehearsed on gloo/CPU (slow), and the rule
that the GPU path needs no package beyond those the GPU machine has or the wheels carry."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _clean_env(**extra) -> dict:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_every_check_passes_on_cpu(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--allow-cpu", "--bench-steps", "3",
         "--bench-max-length", "64", "--bench-micro-batch", "1", "--bench-global-batch", "2"],
        cwd=REPO, env=_clean_env(OUT=str(tmp_path), PYTHON=sys.executable),
        capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line.split(":")[0] for line in lines] == [
        "PASS fp32", "PASS bf16", "PASS packed", "PASS resume", "PASS bench",
        "PASS bench-selective"]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["failed"] == 0
    assert result["checks"]["fp32"]["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)
    assert result["checks"]["bf16"]["max_rel"] <= 1e-3
    assert result["checks"]["resume"]["max_rel"] <= 1e-6


def test_missing_wheels_fail_with_a_clear_line(tmp_path):
    # A python without megatron-core: the script must say what to do, not fail in an import.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env=_clean_env(PYTHON=str(fake), GPU_WHEELS=str(tmp_path / "none")))
    assert proc.returncode == 1
    assert "FAIL install" in proc.stdout and "scripts/gpu_wheels.sh" in proc.stdout


def test_the_gpu_path_needs_only_what_the_gpu_machine_has_or_the_wheels_carry():
    """The H200 image has torch, numpy, packaging, PyYAML, jinja2, tensorboard, transformers,
    safetensors, psutil; the wheels carry megatron-core and omegaconf. Nothing else may be
    imported on the way to a GPU check step (datasets, for one, is not there)."""
    code = ("import sys; sys.path.insert(0, 'scripts')\n"
            "import gpu_check, gpu_bench\n"
            "import dpo_megatron.train, dpo_megatron.config, dpo_megatron.training.trainer\n"
            "bad = [m for m in ('datasets', 'trl', 'peft', 'pandas', 'pyarrow', 'sentencepiece')"
            " if m in sys.modules]\n"
            "print(bad)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=_clean_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
