"""scripts/pretrain_dpo.sh: launches torchrun itself, and runs in place under torchrun --no-python."""

import math
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, run_dir):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    out = subprocess.run(cmd + [f"run_dir={run_dir}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\[train\] step \d+/2 \| loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 2, out.stdout[-3000:]
    assert abs(losses[0] - math.log(2)) < 1e-4  # printed to 4 decimals
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "iter_0000002"))
    assert "layout TP" in out.stdout
    return out.stdout


def test_self_launch_tp2(tmp_path):
    stdout = _run(["bash", "scripts/pretrain_dpo.sh", "--config", "configs/tiny_cpu.yaml",
                   "parallel.tensor_model_parallel_size=2"], str(tmp_path / "run"))
    assert "TP 2 x PP 1 x DP 1" in stdout


def test_under_torchrun_no_python_pp2(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    stdout = _run([torchrun, "--nproc-per-node", "2", "--no-python", "scripts/pretrain_dpo.sh",
                   "--config", "configs/tiny_cpu.yaml", "parallel.pipeline_model_parallel_size=2"],
                  str(tmp_path / "run"))
    # One job of 2 ranks (no nested launch): one layout line, PP 2.
    assert stdout.count("layout TP") == 1 and "TP 1 x PP 2 x DP 1" in stdout
