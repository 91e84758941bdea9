"""scripts/gpu_check.sh: the GPU check rehearsed on gloo/CPU (every check, with failures injected
between them), what a cut-short run leaves, the exact peak-FLOPs table, the CPU baseline's
hidden CUDA, and the rule that the GPU path needs no package the GPU machine lacks."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]


gpu_bench = load_script("gpu_bench")
gpu_check = load_script("gpu_check")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in gpu_check.LAUNCHER_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}


def _start(tmp_path, *args, **env) -> subprocess.Popen:
    """``gpu_check.sh ARGS`` on the CPU (gloo, tiny shapes), results in ``tmp_path``."""
    return subprocess.Popen(
        ["bash", "scripts/gpu_check.sh", "--allow-cpu", "--tiny", *args],
        cwd=REPO,
        env=_clean_env(OUT=str(tmp_path), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet (it is replaced whole, never half-written)
        return None


def _finished(result) -> list[str]:
    return [n for n, c in result["checks"].items() if "pass" in c]


# ----------------------------------------------------------------------------------------------
# the peak table and the CPU baseline's environment (no engine run)


def test_peak_table_is_exact_per_sku():
    peak = gpu_bench.peak_tflops
    # one chip, three boards: matched by the full name, not by "H100" / "H200"
    assert peak("NVIDIA H100 80GB HBM3") == (989.4, "H100 SXM")
    assert peak("NVIDIA H100 PCIe") == (756.5, "H100 PCIe")
    assert peak("NVIDIA H100 NVL") == (835.5, "H100 NVL")
    assert peak("NVIDIA H200") == (989.4, "H200 SXM")
    assert peak("NVIDIA H200 NVL") == (835.5, "H200 NVL")
    assert peak("NVIDIA GH200 480GB") == (989.4, "GH200")
    for a100 in (
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA A100-PCIE-40GB",
        "NVIDIA A100 80GB PCIe",
    ):
        assert peak(a100)[0] == 312.0
    assert peak("nvidia  h100 pcie") == (756.5, "H100 PCIe")  # case and spacing aside
    # a name that merely contains a known one is unknown: MFU is then reported as unknown
    for name in (
        "NVIDIA H100",
        "NVIDIA H200 141GB HBM3e MIG 1g.18gb",
        "Tesla V100-SXM2-16GB",
        "cpu",
    ):
        tflops, sku = peak(name)
        assert tflops is None and f"unknown GPU {name!r}" in sku
    assert peak("Tesla V100-SXM2-16GB", 125.0) == (125.0, "given: Tesla V100-SXM2-16GB")


def test_the_cpu_baseline_runs_with_cuda_hidden(monkeypatch):
    """A gloo worker (the CPU baseline, or any with --allow-cpu: the engine's CPU redirection is
    on there) sees no GPU; an NCCL worker keeps the GPUs it was given; neither inherits a
    launcher's rank variables."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("RANK", "5")
    gloo, nccl = gpu_check.worker_env("gloo"), gpu_check.worker_env("nccl")
    assert gloo["CUDA_VISIBLE_DEVICES"] == "" and nccl["CUDA_VISIBLE_DEVICES"] == "3"
    assert "RANK" not in gloo and "RANK" not in nccl
    assert {c.name for c in gpu_check.CHECKS if c.role == "cpu"} == {
        "cpu-llama",
        "cpu-gpt2",
        "cpu-moe",
    }


def test_plan_places_injected_checks_and_rejects_unknown_names():
    names = [c.name for c in gpu_check.plan(["flex", "bench"], ["raise@1", "hang@0"], 3.0)]
    assert names == ["inject-hang-0", "flex", "inject-raise-1", "bench"]
    with pytest.raises(ValueError, match="unknown nope"):
        gpu_check.plan(["nope"], [], 3.0)
    with pytest.raises(ValueError, match="KIND@POS"):
        gpu_check.plan(None, ["boom@1"], 3.0)


# ----------------------------------------------------------------------------------------------
# the script, rehearsed


def test_budget_spent_marks_the_rest_not_run(tmp_path):
    """A check that hangs is stopped at the budget; the checks after it are recorded as not
    run, and the exit status counts them all."""
    proc = _start(
        tmp_path,
        "--checks",
        "flex,bench",
        "--inject",
        "hang@0",
        "--inject-cap",
        "600",
        GPU_CHECK_BUDGET="3",
    )
    out, _ = proc.communicate(timeout=300)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 3, out
    assert result["state"] == "done" and result["budget_s"] == 3
    hang, flex, bench = (result["checks"][n] for n in ("inject-hang-0", "flex", "bench"))
    assert hang["status"] == "timeout" and hang["line"] == "timed out after 3 s"
    assert 3 <= hang["time_s"] < 60
    assert (
        flex
        == bench
        == {"pass": False, "status": "not run", "line": "not run: the time budget of 3 s was spent"}
    )
    assert "FAIL inject-hang-0: timed out after 3 s" in out


def test_a_stopped_run_keeps_the_checks_done(tmp_path):
    """SIGTERM (what gpu_check.sh's `timeout` sends) in the middle of a check: the check done
    is in the JSON, the one in flight is marked stopped, the rest not run; exit status 124."""
    json_path = tmp_path / "gpu_check.json"
    proc = _start(
        tmp_path,
        "--checks",
        "bench",
        "--inject",
        "raise@0",
        "--inject",
        "hang@1",
        "--inject-cap",
        "600",
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            result = _read(json_path)
            if result and result["checks"]["inject-hang-1"]["status"] == "running":
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        assert _finished(result) == ["inject-raise-0"]  # on disk while the run goes on
        os.kill(result["pid"], signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    result = json.loads(json_path.read_text())
    assert proc.returncode == 124, out
    assert "FAIL time: stopped" in out
    assert result["state"] == "stopped"
    assert result["checks"]["inject-raise-0"]["status"] == "fail"
    assert result["checks"]["inject-hang-1"]["status"] == "stopped"
    assert result["checks"]["inject-hang-1"]["line"] == "stopped by SIGTERM while running"
    assert result["checks"]["bench"] == {
        "pass": False,
        "status": "not run",
        "line": "not run: stopped by SIGTERM",
    }


@pytest.mark.slow
def test_rehearsal_of_every_check_with_failures_injected(tmp_path):
    """The whole script on gloo/CPU with tiny shapes: every check runs and is recorded; an
    exception, a dead worker and a time-out (injected between the CPU baselines and the device
    checks, which then start in a fresh worker) stop nothing; the JSON is rewritten after each
    check (watched while the run goes on)."""
    json_path = tmp_path / "gpu_check.json"
    proc = _start(
        tmp_path,
        "--cap-scale",
        "20",
        "--inject",
        "raise@3",
        "--inject",
        "exit@4",
        "--inject",
        "hang@5",
        "--inject-cap",
        "0.25",
        GPU_CHECK_BUDGET="3000",
    )
    seen = []  # the finished checks of every state of the file
    try:
        while proc.poll() is None:
            result = _read(json_path)
            if result and (not seen or _finished(result) != seen[-1]):
                seen.append(_finished(result))
            time.sleep(0.01)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    result = json.loads(json_path.read_text())
    order = result["order"]
    assert order == [
        "cpu-llama",
        "cpu-gpt2",
        "cpu-moe",
        "inject-raise-3",
        "inject-exit-4",
        "inject-hang-5",
        "flex",
        "fp32-llama",
        "bf16-llama",
        "bf16-gpt2",
        "packed",
        "shared-prompt",
        "lora",
        "moe",
        "bench",
        "bench-shared",
        "resume",
    ]
    # rewritten after each check: the file held every prefix of the order, in turn
    assert seen[0] == [] and seen == [order[:k] for k in range(len(order) + 1)], seen
    checks = result["checks"]
    assert result["state"] == "done" and all("time_s" in checks[n] for n in order)
    raised, died, hung = (checks[n] for n in ("inject-raise-3", "inject-exit-4", "inject-hang-5"))
    assert raised["status"] == "fail" and "injected failure (--inject raise)" in raised["error"]
    assert died["line"] == "the device worker exited with status 3 before reporting"
    assert "injected crash (--inject exit)" in died["error"]
    assert hung["status"] == "timeout" and hung["line"] == "timed out after 5 s"
    # every real check passed, the one right after the failures included
    failed = {n for n in order if not checks[n]["pass"]}
    assert failed == {"inject-raise-3", "inject-exit-4", "inject-hang-5"}, out
    assert proc.returncode == 3
    assert [
        line.split(":")[0] for line in out.splitlines() if line.startswith(("PASS", "FAIL"))
    ] == [f"{'FAIL' if n in failed else 'PASS'} {n}" for n in order]
    # the numbers behind the PASS lines
    for name in ("cpu-llama", "cpu-gpt2", "cpu-moe"):
        assert checks[name]["cuda_visible_devices"] == ""
        assert checks[name]["cuda_available"] is False
        assert checks[name]["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)
    assert checks["fp32-llama"]["max_rel"] <= gpu_check.FP32_REL
    for name in ("bf16-llama", "bf16-gpt2", "packed", "shared-prompt", "lora"):
        assert checks[name]["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)
        assert checks[name]["max_rel"] <= gpu_check.BF16_REL
    assert checks["moe"]["max_rel"] <= gpu_check.MOE_REL
    assert checks["lora"]["steps"][1]["loss"] != checks["lora"]["loss"]
    assert checks["flex"]["out_max_rel"] <= gpu_check.FLEX_REL
    assert checks["resume"]["max_rel"] <= 1e-6
    for name in ("bench", "bench-shared"):
        bench = checks[name]
        assert bench["step0_loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
        assert bench["mfu"] is None and "unknown GPU 'cpu'" in bench["sku"]
        assert (tmp_path / "gpu_check_logs" / f"{name}.json").exists()


def test_missing_wheels_fail_with_a_clear_line(tmp_path):
    # A python without megatron-core: the script must say what to do, not fail in an import.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(PYTHON=str(fake), GPU_WHEELS=str(tmp_path / "none")),
    )
    assert proc.returncode == 1
    assert "FAIL install" in proc.stdout and "scripts/gpu_wheels.sh" in proc.stdout
    assert "git-ignored" in proc.stdout


def test_without_python_set_a_set_up_machine_runs_its_venv(tmp_path):
    """GPU.md's CPU rehearsal, ``bash scripts/gpu_check.sh --allow-cpu --tiny ...`` as written
    (no PYTHON): on a set-up machine it takes the repository's .venv, as the other launchers do;
    python3 on PATH (here one without megatron-core) is only the bare machine's fallback."""
    if not os.access(REPO / ".venv" / "bin" / "python", os.X_OK):
        pytest.skip("no .venv: not a set-up machine")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    env = _clean_env(OUT=str(tmp_path), GPU_WHEELS=str(tmp_path / "none"))
    del env["PYTHON"]
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--allow-cpu", "--tiny", "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cpu-llama" in proc.stdout and "FAIL install" not in proc.stdout


def test_the_gpu_path_needs_only_what_the_gpu_machine_has_or_the_wheels_carry():
    """The bare GPU image has torch, numpy, packaging, PyYAML, jinja2, tensorboard, transformers,
    safetensors, psutil; the wheels carry megatron-core and omegaconf. Nothing else may be
    imported on the way to a GPU check step (datasets, for one, is not there)."""
    code = (
        "import sys; sys.path.insert(0, 'scripts')\n"
        "import gpu_check, gpu_bench\n"
        "import dpo_megatron.cli.train, dpo_megatron.config, dpo_megatron.training.trainer\n"
        "import dpo_megatron.models.attention, dpo_megatron.data.packing\n"
        "bad = [m for m in ('datasets', 'trl', 'peft', 'pandas', 'pyarrow', 'sentencepiece')"
        " if m in sys.modules]\n"
        "print(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ----------------------------------------------------------------------------------------------
# the device checks on a device that is not the host (tests/strict_device.py)

STRICT_CHECKS = (
    "fp32-llama",
    "bf16-llama",
    "bf16-gpt2",
    "packed",
    "shared-prompt",
    "lora",
    "moe",
    "resume",
)
"""The checks that run the engine on the device (flex calls a kernel; the bench is a
subprocess of its own, with its own device set-up)."""


def _settings(work: str) -> dict:
    return {
        "backend": "gloo",
        "tiny": True,
        "attention": "auto",
        "transformer_impl": "local",
        "seed": 1234,
        "work": work,
        "logs": work,
        "inject": [],
        "bench": {},
    }


def _run_checks(work: str, names: list[str], baselines: dict, strict: bool) -> dict:
    """Run gpu_check's checks ``names`` in this rank (on strict:0 when ``strict``)."""
    import contextlib

    by_name = {c.name: c for c in gpu_check.CHECKS}
    settings = _settings(work)
    if strict:
        from tests.strict_device import StrictDevice

        context = StrictDevice()
    else:
        context = contextlib.nullcontext()
    out = {}
    with context:
        for name in names:
            check = by_name[name]
            out[name] = check.run(settings, baselines.get(check.baseline))
    return out


@pytest.mark.slow
def test_the_device_checks_pass_on_the_strict_device(tmp_path):
    """The rehearsal's device checks on ``strict:0``, a device that is not the host (the CPU
    baselines on the plain CPU, in their own rank): each passes, and runs on ``strict:0``, so no
    check's engine run leaves a tensor on the host that a GPU would refuse."""
    from tests.multirank import run_ranks

    work = str(tmp_path)
    baselines = run_ranks(
        _run_checks,
        world_size=1,
        work=work,
        names=["cpu-llama", "cpu-gpt2", "cpu-moe"],
        baselines={},
        strict=False,
    )[0]
    assert all(b["pass"] for b in baselines.values()), baselines
    results = run_ranks(
        _run_checks,
        world_size=1,
        work=work,
        names=list(STRICT_CHECKS),
        baselines=baselines,
        strict=True,
    )[0]
    for name in STRICT_CHECKS:
        record = results[name]
        assert record["pass"], (name, record["line"])
        assert record["line"].startswith("strict:0"), (name, record["line"])
