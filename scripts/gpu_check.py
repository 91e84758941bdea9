#!/usr/bin/env python
"""The engine on one GPU, checked in one short run: each check prints PASS or FAIL with numbers.

    python scripts/gpu_check.py                  # on a CUDA machine (scripts/gpu_check.sh wraps it)
    python scripts/gpu_check.py --allow-cpu      # the same checks on gloo/CPU (a smoke test)

Checks (each engine run is a fresh single-rank process, through the engine's ``Trainer``):

1. ``fp32``: a tiny DPO step on NCCL at TP 1 in fp32: step-0 loss ln 2; per-pair log-probs equal
   the CPU (gloo) run of the same weights within 1e-5 relative.
2. ``bf16``: the same in bf16: step-0 loss ln 2; log-probs within 1e-3 relative of the CPU run.
3. ``packed``: bf16 with packed pairs (``model.local_attention`` as given): ln 2; log-probs within
   1e-3 relative of the CPU run.
4. ``resume``: 4 steps straight vs 2 steps + checkpoint + resume for 2: the same losses and
   grad norms (bit-identical is reported; PASS within 1e-6 relative).
5. ``bench``: ``scripts/gpu_bench.py`` on the Llama-3.2-1B shape (bf16, distributed optimizer)
   with recompute off and selective: tokens/s and MFU counting the reference forward.

The weights of checks 1-3 come from one model checkpoint written by a CPU process, so the GPU
and CPU runs start from identical values. Results: a JSON file (``--out``) and the PASS/FAIL
lines; the exit status is the number of failed checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY = dict(num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
            num_query_groups=2, vocab_size=512, max_position_embeddings=512,
            tie_word_embeddings=False)
LN2 = math.log(2)


# ----------------------------------------------------------------------------------------------
# worker: one engine run in this process


def _pairs(n: int, seed: int):
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_bench import synthetic_pairs

    return synthetic_pairs(n, TINY["vocab_size"], 96, seed)


def run_worker(spec: dict) -> dict:
    """One Trainer run: ``spec`` names backend, dtype, packing, steps, checkpointing."""
    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.config import config_from_mapping
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    if spec.get("make_checkpoint"):
        from dpo_megatron.models import ModelConfig, build_model_chunks
        from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

        parallel = ParallelConfig(backend="gloo")
        initialize_distributed(parallel)
        set_seed(spec["seed"])
        save_model_checkpoint(build_model_chunks(ModelConfig(**TINY, params_dtype="float32"),
                                                 parallel), spec["make_checkpoint"])
        return {}
    cfg = config_from_mapping({
        "run_dir": spec["run_dir"],
        "parallel": {"backend": spec["backend"]},
        "model": {**TINY, "load": spec["init"], "params_dtype": spec["dtype"],
                  "transformer_impl": "local", "local_attention": spec["attention"]},
        "data": {"shuffle": False},
        "loss": {"name": "sigmoid", "beta": 0.1},
        "train": {"lr": 1e-4, "lr_decay_style": "constant", "train_iters": spec["steps"],
                  "global_batch_size": 8, "micro_batch_size": 2, "seed": spec["seed"],
                  "use_distributed_optimizer": True},
        "packing": {"enabled": spec["packing"]},
        "checkpoint": {"save_interval": spec.get("save_interval", 0),
                       "resume": spec.get("resume", "none"), "keep_last_n": 0},
        "logging": {"tensorboard": False},
    }, check=False)
    trainer = Trainer(cfg, data=RunData(_pairs(32, spec["seed"]), [], 2))  # 4 steps of 8
    steps = []
    while trainer.counters.step < cfg.train.train_iters:
        out, _ = trainer.train_step()
        steps.append({"step": trainer.counters.step, "loss": out.metrics["loss"],
                      "grad_norm": out.grad_norm,
                      "logps": out.per_pair["logps/chosen"].tolist()
                      + out.per_pair["logps/rejected"].tolist()})
        if trainer.checkpointer.due(trainer.counters.step, cfg.train.train_iters):
            trainer.checkpointer.save(trainer.counters)
    return {"device": str(trainer.device), "steps": steps}


def _run(spec: dict, timeout: float) -> dict:
    """``run_worker(spec)`` in a fresh single-rank process (its own process group and device)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.setdefault("OMP_NUM_THREADS", "4")
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec), "--worker-out",
                           out], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-1500:] + proc.stderr[-3000:])
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


# ----------------------------------------------------------------------------------------------
# checks


def _max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


class Report:
    """PASS / FAIL lines and the JSON record of every check."""

    def __init__(self):
        self.checks: dict[str, dict] = {}

    def record(self, name: str, ok: bool, line: str, **numbers) -> None:
        self.checks[name] = {"pass": ok, "line": line, **numbers}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {line}", flush=True)

    def failed(self) -> int:
        return sum(not c["pass"] for c in self.checks.values())


def check_numerics(report: Report, work: Path, backend: str, attention: str, timeout: float,
                   seed: int) -> None:
    init = str(work / "init")
    _run({"make_checkpoint": init, "seed": seed}, timeout)
    base = {"init": init, "seed": seed, "steps": 1, "packing": False, "attention": attention}
    cpu = _run({**base, "run_dir": str(work / "cpu"), "backend": "gloo", "dtype": "float32"},
               timeout)["steps"][0]
    cases = {"fp32": ("float32", False, 1e-5), "bf16": ("bfloat16", False, 1e-3),
             "packed": ("bfloat16", True, 1e-3)}
    for name, (dtype, packed, tolerance) in cases.items():
        try:
            t0 = time.time()
            run = _run({**base, "run_dir": str(work / name), "backend": backend, "dtype": dtype,
                        "packing": packed}, timeout)
            step0 = run["steps"][0]
            rel = _max_rel(step0["logps"], cpu["logps"])
            ok = abs(step0["loss"] - LN2) < 1e-6 and rel <= tolerance
            report.record(name, ok, f"{run['device']} {dtype}{' packed' if packed else ''}: "
                          f"step-0 loss {step0['loss']:.8f} (ln 2 = {LN2:.8f}), log-probs vs "
                          f"CPU fp32 max rel diff {rel:.2e} (<= {tolerance:g}), "
                          f"{time.time() - t0:.0f} s", loss=step0["loss"], max_rel=rel)
        except Exception as e:  # a failing check must not hide the others
            report.record(name, False, f"raised {str(e)[-800:]}")


def check_resume(report: Report, work: Path, backend: str, attention: str, timeout: float,
                 seed: int) -> None:
    base = {"init": str(work / "init"), "seed": seed, "packing": False, "dtype": "bfloat16",
            "attention": attention, "backend": backend}
    try:
        straight = _run({**base, "run_dir": str(work / "straight"), "steps": 4}, timeout)
        _run({**base, "run_dir": str(work / "cut"), "steps": 2, "save_interval": 2}, timeout)
        resumed = _run({**base, "run_dir": str(work / "cut"), "steps": 4, "resume": "auto"},
                       timeout)
        want = [s for s in straight["steps"] if s["step"] > 2]
        got = resumed["steps"]
        exact = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
                    for a, b in zip(got, want, strict=True))
        rel = max(_max_rel([a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]])
                  for a, b in zip(got, want, strict=True))
        report.record("resume", rel <= 1e-6,
                      f"steps 3-4 resumed from the step-2 checkpoint vs straight: "
                      f"{'bit-identical' if exact else 'not bit-identical'}, max rel diff "
                      f"{rel:.2e}", bit_identical=exact, max_rel=rel)
    except Exception as e:
        report.record("resume", False, f"raised {str(e)[-800:]}")


def check_bench(report: Report, work: Path, args) -> None:
    for recompute in ("", "selective"):
        name = f"bench{'-' + recompute if recompute else ''}"
        out = work / f"{name}.json"
        cmd = [sys.executable, str(REPO / "scripts" / "gpu_bench.py"), "--out", str(out),
               "--steps", str(args.bench_steps), "--warmup", "2", "--max-length",
               str(args.bench_max_length), "--micro-batch-size", str(args.bench_micro_batch),
               "--global-batch-size", str(args.bench_global_batch), "--local-attention",
               args.local_attention, "--transformer-impl", "local"]
        if recompute:
            cmd += ["--recompute", recompute]
        if args.bench_packing:
            cmd += ["--packing"]
        if args.allow_cpu:
            cmd += ["--allow-cpu", "--tiny"]
        try:
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                raise RuntimeError(proc.stdout[-800:] + proc.stderr[-1500:])
            r = json.loads(out.read_text())
            ok = abs(r["step0_loss"] - LN2) < 1e-3 and r["real_tokens_per_s"] > 0
            report.record(name, ok, f"{r['device']} {r['params'] / 1e9:.2f} B params: "
                          f"{r['real_tokens_per_s']:.0f} real tokens/s, MFU {r['mfu']:.1%} "
                          f"(policy fwd+bwd + reference fwd), step {r['step_time_median_s']:.3f} s,"
                          f" padded fraction {r['padded_fraction']:.2f}, peak memory "
                          f"{r['peak_memory_gib'] or 0:.1f} GiB, step-0 loss "
                          f"{r['step0_loss']:.6f}, {time.time() - t0:.0f} s",
                          **{k: r[k] for k in ("real_tokens_per_s", "mfu", "step_time_median_s",
                                               "peak_memory_gib", "padded_fraction")})
        except Exception as e:
            report.record(name, False, f"raised {str(e)[-800:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run every check on gloo/CPU (the bench on the tiny model)")
    parser.add_argument("--local-attention", default="sdpa", help="model.local_attention")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--bench-steps", type=int, default=8)
    parser.add_argument("--bench-max-length", type=int, default=2048)
    parser.add_argument("--bench-micro-batch", type=int, default=4, help="pairs")
    parser.add_argument("--bench-global-batch", type=int, default=16, help="pairs")
    parser.add_argument("--bench-packing", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per engine run")
    parser.add_argument("--out", default="runs/gpu_check/gpu_check.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(run_worker(json.loads(args.worker))))
        return 0

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --allow-cpu", file=sys.stderr)
        return 2
    backend = "gloo" if args.allow_cpu else "nccl"
    name = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
    print(f"gpu_check on {name}: torch {torch.__version__}, python {sys.version.split()[0]}",
          flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = Report()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        check_numerics(report, work, backend, args.local_attention, args.timeout, args.seed)
        check_resume(report, work, backend, args.local_attention, args.timeout, args.seed)
        if not args.skip_bench:
            check_bench(report, work, args)
    failed = report.failed()
    summary = {"device": name, "torch": torch.__version__, "total_s": time.time() - started,
               "failed": failed, "checks": report.checks}
    out.write_text(json.dumps(summary, indent=1))
    print(f"{len(report.checks) - failed} passed, {failed} failed in "
          f"{time.time() - started:.0f} s; results in {out}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
