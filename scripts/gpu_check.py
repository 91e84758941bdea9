#!/usr/bin/env python
"""The engine on one GPU, checked in one run that always reports: PASS / FAIL per check.

    bash scripts/gpu_check.sh                           # on the GPU machine (installs the wheels)
    python scripts/gpu_check.py --allow-cpu --tiny      # CPU rehearsal (tests/test_gpu_check.py)
    python scripts/gpu_check.py --list                  # the checks, in order

Each check is a short ``Trainer`` run (through :func:`gpu_bench.run_config`, the benchmark's own
config) or a kernel call of the engine, in a worker process:

=================  ==============================================================================
``cpu-llama``      CPU baseline (a worker with ``CUDA_VISIBLE_DEVICES=""``, gloo, fp32): writes
``cpu-gpt2``       the initial weights of a Llama / GPT-2 / MoE shape as a checkpoint and runs
``cpu-moe``        one step of them: step-0 loss ln 2, per-pair log-probs kept for the checks
                   below, which load the same checkpoint on the device.
``flex``           the engine's FlexAttention (``models.attention.flex_block_mask`` /
                   ``flex_attention_rows``) on a packed shared-prompt micro-batch vs the dense
                   rule (``visible_keys`` + SDPA in fp32): outputs, and on CUDA the gradients.
``fp32-llama``     one step in fp32: ln 2; log-probs within 1e-5 relative of the CPU baseline.
``bf16-llama``     the same in bf16 (``BF16_REL``), and ``bf16-gpt2`` (learned positions,
``bf16-gpt2``      LayerNorm, biases, GELU).
``packed``         bf16, packed pairs (``packing.enabled``); ``shared-prompt``: one
``shared-prompt``  [prompt | chosen | rejected] unit per pair. Both with ``--local-attention``
                   (``auto``: FlexAttention on CUDA); log-probs vs the padded CPU baseline.
``lora``           bf16 LoRA: step 0 equals the base (ln 2, log-probs vs the baseline), step 1
                   moves the adapters (loss != ln 2).
``moe``            bf16, 4 experts, top-2 (``MOE_REL``, routing may flip in bf16).
``bench``          ``gpu_bench.main`` on the Llama-3.2-1B shape at sequence length 2048, padded,
``bench-shared``   and with shared prompts: tokens/s and MFU counting the reference forward
                   (``gpu_bench.peak_tflops``: exact per SKU; unknown GPU -> MFU unknown), and
                   the peak memory beside the layout planner's prediction of it.
``resume``         bf16: 4 steps straight vs 2 + checkpoint + resume for 2: same losses.
=================  ==============================================================================

Always reports: a check's exception, crash or time-out is recorded (with the last lines of its
error and its time) and the next check runs, in a fresh worker. The JSON (``--out``) is written
before the first check and rewritten after each one, so a run cut short keeps every check done;
``--budget`` caps the whole run (a check gets at most what is left; the rest are marked
``not run``) and SIGTERM (``timeout`` in ``gpu_check.sh``) records the check in flight. The exit
status is the number of checks that did not pass (124 when stopped by a signal).

``--inject KIND@POS`` (``raise``, ``exit``, ``hang``) inserts a failing check at position POS:
the rehearsal's way to show that a failure, a dead worker or a time-out stops nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

LN2 = math.log(2)
FP32_REL = 1e-5
"""fp32 on the device vs fp32 on the CPU: per-pair log-probs, max relative difference."""
BF16_REL = 1e-3
"""bf16 on the device vs fp32 on the CPU: per-pair log-prob sums (24-48 tokens of a random
model, about -6 nats each), max relative difference. The CPU rehearsal measures 6e-5 (bf16
weights and activations, fp32 accumulation, fp32 log-softmax)."""
MOE_REL = 5e-3
"""As BF16_REL for the MoE model: a token whose top-2 experts are nearly tied may be routed to
another expert in bf16 than in fp32 (the CPU rehearsal measures 8e-5)."""
FLEX_REL = 1e-2
"""FlexAttention in bf16 vs the dense rule in fp32 on the same bf16 inputs: max absolute
difference of outputs and of q / k / v gradients, over the largest value of each (the CPU
rehearsal measures 3.5e-3 for the output: bf16 output rounding)."""
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


# ----------------------------------------------------------------------------------------------
# shapes and engine runs (inside a worker)


def model_shape(arch: str, tiny: bool) -> dict:
    """``model.*`` keys of the small ``llama`` / ``gpt2`` / ``moe`` models the checks train."""
    hidden = 64 if tiny else 128
    shape = dict(
        num_layers=2 if tiny else 4,
        hidden_size=hidden,
        ffn_hidden_size=2 * hidden,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=256 if tiny else 512,
        max_position_embeddings=256 if tiny else 512,
        tie_word_embeddings=False,
    )
    if arch == "gpt2":  # as models.conversion maps a GPT-2 config.json
        shape.update(
            num_query_groups=4,
            ffn_hidden_size=4 * hidden,
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            activation="gelu",
            add_bias_linear=True,
            add_qkv_bias=True,
            tie_word_embeddings=True,
        )
    elif arch == "moe":
        shape.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=hidden)
    elif arch != "llama":
        raise ValueError(f"unknown check model {arch!r}: llama, gpt2 or moe")
    return shape


def _batches(settings: dict) -> dict:
    """Pairs per step / micro-batch and their longest sequence."""
    if settings["tiny"]:
        return {"global_batch_size": 4, "micro_batch_size": 2, "max_length": 48}
    return {"global_batch_size": 8, "micro_batch_size": 2, "max_length": 96}


def engine_run(
    settings: dict,
    arch: str,
    run_dir: str,
    *,
    backend: str,
    dtype: str,
    steps: int = 1,
    load: str = "",
    lr: float = 1e-4,
    packing: bool = False,
    share_prompt: bool = False,
    lora: bool = False,
    save_interval: int = 0,
    resume: str = "none",
) -> dict:
    """``steps`` optimizer steps of the engine's ``Trainer`` on synthetic pairs (the same pairs
    for the same settings), in this process.

    Returns:
        {"device": str, "steps": [{"step", "loss", "grad_norm", "logps": chosen + rejected
        per-pair log-probs}]}.
    """
    from gpu_bench import run_config, synthetic_pairs

    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    shape, sizes = model_shape(arch, settings["tiny"]), _batches(settings)
    extra: dict[str, dict] = {
        "model": {"load": load},
        "checkpoint": {"save_interval": save_interval, "resume": resume, "keep_last_n": 0},
    }
    if lora:
        extra["lora"] = {"enabled": True, "rank": 8, "alpha": 16.0}
    cfg = run_config(
        run_dir,
        shape,
        steps=steps,
        global_batch_size=sizes["global_batch_size"],
        micro_batch_size=sizes["micro_batch_size"],
        seed=settings["seed"],
        backend=backend,
        params_dtype=dtype,
        lr=lr,
        packing=packing,
        share_prompt=share_prompt,
        local_attention=settings["attention"],
        transformer_impl=settings["transformer_impl"],
        extra=extra,
    )
    pairs = synthetic_pairs(
        sizes["global_batch_size"] * 4, shape["vocab_size"], sizes["max_length"], settings["seed"]
    )
    trainer = Trainer(cfg, data=RunData(pairs, [], 2))
    try:
        records = []
        while trainer.counters.step < steps:
            out, _ = trainer.train_step()
            records.append(
                {
                    "step": trainer.counters.step,
                    "loss": out.metrics["loss"],
                    "grad_norm": out.grad_norm,
                    "logps": out.per_item["logps/chosen"].tolist()
                    + out.per_item["logps/rejected"].tolist(),
                }
            )
            if trainer.checkpointer.due(trainer.counters.step, steps):
                trainer.checkpointer.save(trainer.counters)
        return {"device": str(trainer.device), "steps": records}
    finally:
        trainer.close()


def _max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _work(settings: dict, name: str) -> str:
    return str(Path(settings["work"]) / name)


# ----------------------------------------------------------------------------------------------
# the checks (each returns {"pass": bool, "line": str, **numbers})


def cpu_baseline(settings: dict, arch: str) -> dict:
    """Initial weights of ``arch`` as a checkpoint, and one fp32 step of them on the CPU.

    Runs in the ``cpu`` worker, whose CUDA is hidden (``CUDA_VISIBLE_DEVICES=""``): the engine's
    CPU redirection (``compat.cuda_on_cpu``, on with gloo) never runs beside a visible GPU.
    """
    import torch

    from dpo_megatron.checkpointing import save_model_checkpoint
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    if torch.cuda.is_available():
        raise RuntimeError(
            "the CPU baseline sees CUDA: its worker must run with CUDA_VISIBLE_DEVICES=''"
        )
    init = _work(settings, f"init-{arch}")
    parallel = ParallelConfig(backend="gloo")
    initialize_distributed(parallel)
    set_seed(settings["seed"])
    chunks = build_model_chunks(
        ModelConfig(**model_shape(arch, settings["tiny"]), params_dtype="float32"), parallel
    )
    save_model_checkpoint(chunks, init)
    run = engine_run(
        settings, arch, _work(settings, f"cpu-{arch}"), backend="gloo", dtype="float32", load=init
    )
    step0 = run["steps"][0]
    ok = abs(step0["loss"] - LN2) < 1e-6
    return {
        "pass": ok,
        "line": f"{run['device']} fp32 (CUDA hidden): step-0 loss "
        f"{step0['loss']:.8f} (ln 2 = {LN2:.8f})",
        "loss": step0["loss"],
        "logps": step0["logps"],
        "init": init,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
    }


def device_step(
    settings: dict, baseline: dict | None, arch: str, dtype: str, tolerance: float, **options
) -> dict:
    """One step on the device from the baseline's weights: ln 2 at step 0 and the log-probs
    within ``tolerance`` (relative) of the CPU baseline's. ``options``: :func:`engine_run`'s."""
    name = f"{dtype}-{arch}" + "".join(f"-{k}" for k, v in options.items() if v is True)
    run = engine_run(
        settings,
        arch,
        _work(settings, name),
        backend=settings["backend"],
        dtype=dtype,
        load=baseline["init"] if baseline else "",
        **options,
    )
    step0 = run["steps"][0]
    line = (
        f"{run['device']} {dtype}: step-0 loss {step0['loss']:.8f} "
        f"(ln 2 {'+' if step0['loss'] >= LN2 else '-'} {abs(step0['loss'] - LN2):.1e})"
    )
    numbers = {"loss": step0["loss"], "grad_norm": step0["grad_norm"], "steps": run["steps"]}
    ok = abs(step0["loss"] - LN2) < 1e-6 and math.isfinite(step0["grad_norm"])
    if baseline is None:
        return {
            "pass": False,
            "line": line + "; no CPU baseline to compare with (it failed)",
            **numbers,
        }
    rel = _max_rel(step0["logps"], baseline["logps"])
    return {
        "pass": ok and rel <= tolerance,
        "line": line + f", log-probs vs CPU fp32 max rel diff {rel:.2e} (<= {tolerance:g})",
        "max_rel": rel,
        **numbers,
    }


def check_lora(settings: dict, baseline: dict | None) -> dict:
    """LoRA in bf16: step 0 is the base model (B = 0), step 1 has moved the adapters."""
    record = device_step(
        settings, baseline, "llama", "bfloat16", BF16_REL, lora=True, steps=2, lr=1e-3
    )
    second = record["steps"][1]["loss"]
    moved = second != LN2 and math.isfinite(second)
    record["line"] += f"; step-2 loss {second:.8f} ({'moved' if moved else 'still ln 2'})"
    record["pass"] = record["pass"] and moved
    return record


def check_flex(settings: dict, baseline: dict | None) -> dict:
    """The engine's FlexAttention kernel on one packed shared-prompt micro-batch (GQA, bf16)
    against the dense visibility rule in fp32: outputs, and on CUDA the gradients of q, k, v
    (torch has no FlexAttention backward on the CPU: forward only there)."""
    import torch
    import torch.nn.functional as F
    from gpu_bench import synthetic_pairs

    from dpo_megatron.data.packing import pack_shared_prompt_pairs, shared_pair_length
    from dpo_megatron.models.attention import flex_attention_rows, flex_block_mask, visible_keys
    from dpo_megatron.parallel.device import get_device

    device = get_device()
    tiny = settings["tiny"]
    pairs = synthetic_pairs(4 if tiny else 8, 256, 64 if tiny else 512, settings["seed"])
    length = -(-sum(shared_pair_length(p) for p in pairs) // 128) * 128  # whole flex blocks
    layout = pack_shared_prompt_pairs(pairs, 0, length)[0].packed
    segments, branches = (t.to(device) for t in (layout.segment_ids, layout.branch_ids))
    heads, groups, dim = 8, 2, 32 if tiny else 64
    generator = torch.Generator().manual_seed(settings["seed"])
    q, k, v = (
        torch.randn(1, n, length, dim, generator=generator).to(device, torch.bfloat16)
        for n in (heads, groups, groups)
    )
    backward = device.type == "cuda"
    for t in (q, k, v):
        t.requires_grad_(backward)
    out = flex_attention_rows(q, k, v, flex_block_mask(segments, branches), None)
    # the rule itself: every query's visible keys as a dense mask, fp32, heads repeated for GQA
    qf, kf, vf = (t.detach().float().requires_grad_(backward) for t in (q, k, v))
    dense = F.scaled_dot_product_attention(
        qf,
        kf.repeat_interleave(heads // groups, 1),
        vf.repeat_interleave(heads // groups, 1),
        attn_mask=visible_keys(segments, branches),
    )
    out_diff = ((out.float() - dense).abs().max() / dense.abs().max()).item()
    numbers: dict[str, Any] = {"length": length, "out_max_rel": out_diff}
    ok = out_diff <= FLEX_REL
    line = (
        f"{device} bf16, {len(pairs)} shared-prompt pairs in {length} positions, "
        f"{heads} heads / {groups} KV groups: output max diff {out_diff:.1e} of the largest"
    )
    if backward:
        weight = torch.randn(out.shape, generator=generator).to(device)
        (out.float() * weight).sum().backward()
        (dense * weight).sum().backward()
        grad_diff = max(
            ((a.grad.float() - b.grad).abs().max() / b.grad.abs().max()).item()
            for a, b in ((q, qf), (k, kf), (v, vf))
        )
        numbers["grad_max_rel"] = grad_diff
        ok = ok and grad_diff <= FLEX_REL
        line += f", gradients max diff {grad_diff:.1e} of the largest"
    else:
        line += " (forward only: torch has no FlexAttention backward on the CPU)"
    return {"pass": ok, "line": line + f" (<= {FLEX_REL:g})", **numbers}


def check_resume(settings: dict, baseline: dict | None) -> dict:
    """bf16: 4 steps straight vs 2 steps + checkpoint + resume for 2 (same losses, grad norms)."""
    common = dict(
        backend=settings["backend"], dtype="bfloat16", load=baseline["init"] if baseline else ""
    )
    straight = engine_run(settings, "llama", _work(settings, "straight"), steps=4, **common)
    cut = _work(settings, "cut")
    engine_run(settings, "llama", cut, steps=2, save_interval=2, **common)
    resumed = engine_run(settings, "llama", cut, steps=4, resume="auto", **common)
    want = [s for s in straight["steps"] if s["step"] > 2]
    got = resumed["steps"]
    pairs = list(zip(got, want, strict=True))
    exact = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in pairs)
    rel = max(_max_rel([a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]]) for a, b in pairs)
    return {
        "pass": rel <= 1e-6,
        "line": f"{resumed['device']} bf16: steps 3-4 resumed from the "
        f"step-2 checkpoint vs straight: {'bit-identical' if exact else 'not bit-identical'}"
        f", max rel diff {rel:.2e} (<= 1e-6)",
        "bit_identical": exact,
        "max_rel": rel,
    }


def check_bench(settings: dict, share_prompt: bool) -> dict:
    """``gpu_bench.main``: the Llama-3.2-1B shape, bf16, sequence length ``--bench-max-length``
    (2048), reference forward counted in the model FLOPs; MFU against the exact SKU's peak."""
    import gpu_bench

    bench = settings["bench"]
    name = "bench-shared" if share_prompt else "bench"
    out = Path(settings["work"]) / f"{name}.json"
    argv = [
        "--out",
        str(out),
        "--steps",
        str(bench["steps"]),
        "--warmup",
        str(bench["warmup"]),
        "--max-length",
        str(bench["max_length"]),
        "--micro-batch-size",
        str(bench["micro_batch"]),
        "--global-batch-size",
        str(bench["global_batch"]),
        "--local-attention",
        settings["attention"],
        "--transformer-impl",
        settings["transformer_impl"],
        "--backend",
        settings["backend"],
    ]
    if share_prompt:
        argv.append("--share-prompt")
    if bench["peak_tflops"]:
        argv += ["--peak-tflops", str(bench["peak_tflops"])]
    if settings["tiny"]:
        argv.append("--tiny")
    if settings["backend"] == "gloo":
        argv.append("--allow-cpu")
    status = gpu_bench.main(argv)
    r = json.loads(out.read_text())
    Path(settings["logs"], f"{name}.json").write_text(out.read_text())  # travels back with $OUT
    mfu = (
        f"MFU {r['mfu']:.1%} of {r['sku']} ({r['peak_tflops']:g} TFLOP/s)"
        if r["mfu"] is not None
        else f"MFU unknown: {r['sku']}"
    )
    memory = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "n/a"
    memory += f" (the planner predicts {r['planned_peak_gib']:.1f} GiB)"
    return {
        "pass": status == 0 and r["real_tokens_per_s"] > 0,
        "line": f"{r['device']} {r['params'] / 1e9:.2f} B params, seq <= "
        f"{bench['max_length']}{', shared prompts' if share_prompt else ''}: "
        f"{r['real_tokens_per_s']:.0f} real tokens/s, {mfu} (policy fwd+bwd + "
        f"reference fwd), step {r['step_time_median_s']:.3f} s, padded fraction "
        f"{r['padded_fraction']:.2f}, peak memory {memory}, step-0 loss "
        f"{r['step0_loss']:.6f}",
        **{
            k: r[k]
            for k in (
                "device",
                "sku",
                "peak_tflops",
                "mfu",
                "model_tflops_per_s",
                "real_tokens_per_s",
                "step_time_median_s",
                "peak_memory_gib",
                "planned_peak_gib",
                "padded_fraction",
                "step0_loss",
                "params",
            )
        },
    }


def injected(kind: str) -> Callable[[dict, dict | None], dict]:
    """A check that fails on purpose (``--inject``): ``raise`` an exception, ``exit`` the worker
    (as a CUDA abort would), or ``hang`` past its time-out."""

    def run(settings: dict, baseline: dict | None) -> dict:
        if kind == "raise":
            raise RuntimeError("injected failure (--inject raise)")
        if kind == "exit":
            print("injected crash (--inject exit)", flush=True)
            os._exit(3)
        while True:  # hang
            time.sleep(1)

    return run


@dataclass(frozen=True)
class Check:
    """One check: where it runs (``device`` worker, or the ``cpu`` worker with CUDA hidden), its
    time-out, and the CPU baseline it compares with (that check's record is passed to ``run``)."""

    name: str
    role: str
    cap_s: float
    run: Callable[[dict, dict | None], dict]
    baseline: str | None = None


CHECKS: tuple[Check, ...] = (
    Check("cpu-llama", "cpu", 120, lambda s, b: cpu_baseline(s, "llama")),
    Check("cpu-gpt2", "cpu", 60, lambda s, b: cpu_baseline(s, "gpt2")),
    Check("cpu-moe", "cpu", 60, lambda s, b: cpu_baseline(s, "moe")),
    Check("flex", "device", 150, check_flex),
    Check(
        "fp32-llama",
        "device",
        120,
        lambda s, b: device_step(s, b, "llama", "float32", FP32_REL),
        "cpu-llama",
    ),
    Check(
        "bf16-llama",
        "device",
        90,
        lambda s, b: device_step(s, b, "llama", "bfloat16", BF16_REL),
        "cpu-llama",
    ),
    Check(
        "bf16-gpt2",
        "device",
        90,
        lambda s, b: device_step(s, b, "gpt2", "bfloat16", BF16_REL),
        "cpu-gpt2",
    ),
    Check(
        "packed",
        "device",
        120,
        lambda s, b: device_step(s, b, "llama", "bfloat16", BF16_REL, packing=True),
        "cpu-llama",
    ),
    Check(
        "shared-prompt",
        "device",
        120,
        lambda s, b: device_step(
            s, b, "llama", "bfloat16", BF16_REL, packing=True, share_prompt=True
        ),
        "cpu-llama",
    ),
    Check("lora", "device", 90, check_lora, "cpu-llama"),
    Check(
        "moe", "device", 90, lambda s, b: device_step(s, b, "moe", "bfloat16", MOE_REL), "cpu-moe"
    ),
    # the MFU before resume: if the budget runs short, the figure the run is for comes first
    Check("bench", "device", 240, lambda s, b: check_bench(s, share_prompt=False)),
    Check("bench-shared", "device", 240, lambda s, b: check_bench(s, share_prompt=True)),
    Check("resume", "device", 120, check_resume, "cpu-llama"),
)


def plan(names: list[str] | None, injections: list[str], inject_cap: float) -> list[Check]:
    """The checks to run, in order: ``names`` (None: all) plus the ``KIND@POS`` injections.

    Raises:
        ValueError: an unknown check name or injection.
    """
    by_name = {c.name: c for c in CHECKS}
    unknown = [n for n in names or [] if n not in by_name]
    if unknown:
        raise ValueError(f"--checks: unknown {', '.join(unknown)}; known: {', '.join(by_name)}")
    checks = [by_name[n] for n in names] if names else list(CHECKS)
    for item in injections:
        kind, _, pos = item.partition("@")
        if kind not in ("raise", "exit", "hang") or not pos.isdigit():
            raise ValueError(f"--inject {item!r}: KIND@POS with KIND raise, exit or hang")
        checks.insert(int(pos), Check(f"inject-{kind}-{pos}", "device", inject_cap, injected(kind)))
    return checks


# ----------------------------------------------------------------------------------------------
# the worker: runs the checks it reads on stdin, one JSON line each


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` so that a reader (or a kill) never sees a half-written file."""
    from dpo_megatron.utils.files import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=1), fsync=False)


def serve(role: str, settings: dict) -> int:
    """Run jobs ``{"check", "result", "baseline"}`` from stdin until it closes. A check that
    raises is recorded with its traceback's last lines, then the worker exits (a CUDA error can
    leave the process unusable: the next check gets a fresh worker)."""
    by_name = {c.name: c for c in plan(None, settings["inject"], 0)}
    for line in iter(sys.stdin.readline, ""):
        job = json.loads(line)
        check = by_name[job["check"]]
        print(f"==== {check.name} ({role} worker, pid {os.getpid()})", flush=True)
        try:
            record = check.run(settings, job["baseline"])
        except BaseException:  # noqa: BLE001 - every failure is the check's result
            error = traceback.format_exc()
            print(error, flush=True)
            _write_json(
                Path(job["result"]),
                {
                    "pass": False,
                    "line": "raised " + error.strip().splitlines()[-1][:300],
                    "error": _tail(error),
                },
            )
            return 1
        _write_json(Path(job["result"]), record)
        _release_memory()
    return 0


def _release_memory() -> None:
    import gc

    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.empty_cache()


def _tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def worker_env(backend: str) -> dict:
    """The environment of a worker: no launcher variables (each worker is its own one-rank
    world); for a ``gloo`` worker (the CPU baseline, or every worker with ``--allow-cpu``)
    ``CUDA_VISIBLE_DEVICES=""``, so that a gloo run, and the engine's CPU redirection that comes
    with it (``compat.cuda_on_cpu``), never sees a GPU, even on a GPU machine."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.setdefault("OMP_NUM_THREADS", "4")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class WorkerDied(RuntimeError):
    pass


class CheckTimeout(RuntimeError):
    pass


class Worker:
    """A worker process of one role; its output goes to ``log``."""

    def __init__(self, role: str, settings: dict, log: Path):
        self.role, self.log = role, log
        backend = "gloo" if role == "cpu" else settings["backend"]
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    str(Path(__file__).resolve()),
                    "--serve",
                    role,
                    "--settings",
                    json.dumps({**settings, "backend": backend}),
                ],
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                env=worker_env(backend),
                start_new_session=True,
            )  # killpg reaches its children

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: dict, timeout: float) -> dict:
        """Send ``job`` and wait for its result file.

        Raises:
            WorkerDied: the worker exited without a result.
            CheckTimeout: no result within ``timeout`` seconds (the worker is killed).
        """
        result = Path(job["result"])
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died since its last check (BrokenPipeError)
            pass  # reported below, with its exit status
        deadline = time.monotonic() + timeout
        while not result.exists():
            if self.proc.poll() is not None:
                raise WorkerDied(
                    f"the {self.role} worker exited with status "
                    f"{self.proc.returncode} before reporting"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise CheckTimeout(f"timed out after {timeout:.0f} s")
            time.sleep(0.05)
        return json.loads(result.read_text())

    def kill(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


# ----------------------------------------------------------------------------------------------
# the report and the run


class Report:
    """The JSON file: written at the start, before each check (``running``) and after it."""

    def __init__(self, path: Path, header: dict, checks: list[Check]):
        self.path, self.header, self.started = path, header, time.monotonic()
        self.checks: dict[str, dict] = {c.name: {"status": "pending"} for c in checks}
        self.state = "running"
        self.write()

    def write(self) -> None:
        done = [c for c in self.checks.values() if "pass" in c]
        _write_json(
            self.path,
            {
                **self.header,
                "state": self.state,
                "pid": os.getpid(),
                "elapsed_s": round(time.monotonic() - self.started, 1),
                "passed": sum(c["pass"] for c in done),
                "failed": sum(not c["pass"] for c in done),
                "checks": self.checks,
            },
        )

    def start(self, name: str) -> None:
        self.checks[name] = {"status": "running"}
        self.write()

    def finish(self, name: str, record: dict) -> None:
        record.setdefault("status", "pass" if record["pass"] else "fail")
        self.checks[name] = record
        print(
            f"{'PASS' if record['pass'] else 'FAIL'} {name}: {record['line']}"
            + (f" [{record['time_s']:.0f} s]" if "time_s" in record else ""),
            flush=True,
        )
        self.write()

    def failed(self) -> int:
        return sum(not c.get("pass", False) for c in self.checks.values())


class Stopped(Exception):
    """SIGTERM / SIGINT (``timeout`` in gpu_check.sh, or a user)."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def _log_tail(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return _tail(f.read().decode(errors="replace"))
    except OSError:
        return ""


def run_checks(
    checks: list[Check],
    settings: dict,
    report: Report,
    budget: float,
    logs: Path,
    cap_scale: float = 1.0,
) -> bool:
    """Run ``checks`` in order, each in a worker of its role (a fresh one after any failure)
    with a time-out of its cap x ``cap_scale`` or what is left of ``budget`` (seconds),
    recording each in ``report``. Returns False when stopped by a signal."""
    workers: dict[str, Worker] = {}
    started = time.monotonic()
    current = None
    try:
        for index, check in enumerate(checks):
            left = budget - (time.monotonic() - started)
            if left <= 0:
                report.finish(
                    check.name,
                    {
                        "pass": False,
                        "status": "not run",
                        "line": f"not run: the time budget of {budget:.0f} s was spent",
                    },
                )
                continue
            current, t0 = check.name, time.monotonic()
            report.start(check.name)
            worker = workers.get(check.role)
            if worker is None or not worker.alive():
                log = logs / f"{check.role}-worker-{index:02d}.log"
                worker = workers[check.role] = Worker(check.role, settings, log)
            offset = worker.log.stat().st_size
            baseline = report.checks.get(check.baseline) if check.baseline else None
            job = {
                "check": check.name,
                "baseline": baseline if baseline and baseline.get("pass") else None,
                "result": str(Path(settings["work"]) / f"{index:02d}.json"),
            }
            try:
                record = worker.run(job, min(check.cap_s * cap_scale, left))
            except (WorkerDied, CheckTimeout) as e:
                status = "timeout" if isinstance(e, CheckTimeout) else "fail"
                record = {
                    "pass": False,
                    "status": status,
                    "line": str(e),
                    "error": _log_tail(worker.log, offset),
                }
            record["time_s"] = round(time.monotonic() - t0, 2)
            if not record["pass"]:
                worker.kill()
            report.finish(check.name, record)
            current = None
        return True
    except Stopped as e:
        if current is not None:
            report.checks[current] = {
                "pass": False,
                "status": "stopped",
                "line": f"stopped by {e} while running",
                "time_s": round(time.monotonic() - t0, 2),
            }
            print(f"FAIL {current}: stopped by {e} while running", flush=True)
        for name, record in report.checks.items():
            if record.get("status") == "pending":
                report.checks[name] = {
                    "pass": False,
                    "status": "not run",
                    "line": f"not run: stopped by {e}",
                }
        return False
    finally:
        for worker in workers.values():
            worker.kill()


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run every check on gloo/CPU (the rehearsal)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="smallest shapes, bench on gpu_bench's --tiny model (rehearsal)",
    )
    parser.add_argument("--checks", help="comma-separated subset, in this order (default: all)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds for the whole run (each check also has its own cap)",
    )
    parser.add_argument(
        "--cap-scale",
        type=float,
        default=1.0,
        help="multiply every check's time-out (a slow or shared CPU)",
    )
    parser.add_argument(
        "--local-attention",
        default="auto",
        help="model.local_attention of the packed / shared-prompt checks and "
        "the bench (auto: flex on CUDA, sdpa on the CPU)",
    )
    parser.add_argument("--transformer-impl", default="local", help="model.transformer_impl")
    parser.add_argument("--bench-steps", type=int, default=8)
    parser.add_argument("--bench-warmup", type=int, default=2)
    parser.add_argument("--bench-max-length", type=int, default=2048)
    parser.add_argument("--bench-micro-batch", type=int, default=4, help="pairs")
    parser.add_argument("--bench-global-batch", type=int, default=16, help="pairs")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the GPU's dense bf16 peak, if not in gpu_bench's table",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--out",
        default="runs/gpu_check/gpu_check.json",
        help="the JSON; worker logs and bench results go to gpu_check_logs/ beside it",
    )
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@POS",
        help="insert a failing check (raise, exit, hang) at position POS",
    )
    parser.add_argument(
        "--inject-cap", type=float, default=3.0, help="time-out of injected checks, seconds"
    )
    parser.add_argument("--serve", choices=["device", "cpu"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve, json.loads(args.settings))
    checks = plan(args.checks.split(",") if args.checks else None, args.inject, args.inject_cap)
    if args.list:
        for check in checks:
            print(f"{check.name:14s} {check.role:6s} cap {check.cap_s:4.0f} s")
        return 0

    out = Path(args.out).resolve()
    logs = out.parent / "gpu_check_logs"
    logs.mkdir(parents=True, exist_ok=True)
    from gpu_bench import peak_tflops

    name, cuda_version, torch_version = "cpu", None, _version("torch")
    if not args.allow_cpu:  # the rehearsal's parent imports no torch: it runs nothing itself
        import torch

        if torch.cuda.is_available():
            name, cuda_version = torch.cuda.get_device_name(0), torch.version.cuda
    peak, sku = peak_tflops(name, args.peak_tflops)
    header = {
        "device": name,
        "sku": sku,
        "peak_tflops": peak,
        "torch": torch_version,
        "cuda": cuda_version,
        "python": sys.version.split()[0],
        "budget_s": args.budget,
        "order": [c.name for c in checks],
    }
    print(
        f"gpu_check on {name} ({sku}): torch {torch_version}, python "
        f"{header['python']}, {len(checks)} checks, budget {args.budget:.0f} s",
        flush=True,
    )
    if name == "cpu" and not args.allow_cpu:
        report = Report(out, header, [])
        report.checks["setup"] = {
            "pass": False,
            "status": "fail",
            "line": "no CUDA device: run on a GPU machine, or pass "
            "--allow-cpu for the CPU rehearsal",
        }
        report.state = "done"
        report.write()
        print(f"FAIL setup: {report.checks['setup']['line']}", flush=True)
        return 2
    report = Report(out, header, checks)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        settings = {
            "backend": "gloo" if args.allow_cpu else "nccl",
            "tiny": args.tiny,
            "attention": args.local_attention,
            "transformer_impl": args.transformer_impl,
            "seed": args.seed,
            "work": work,
            "logs": str(logs),
            "inject": args.inject,
            "bench": {
                "steps": args.bench_steps,
                "warmup": args.bench_warmup,
                "max_length": args.bench_max_length,
                "micro_batch": args.bench_micro_batch,
                "global_batch": args.bench_global_batch,
                "peak_tflops": args.peak_tflops,
            },
        }
        if args.tiny:
            settings["bench"].update(
                steps=2, warmup=1, max_length=64, micro_batch=1, global_batch=2
            )
        finished = run_checks(checks, settings, report, args.budget, logs, args.cap_scale)
    report.state = "done" if finished else "stopped"
    report.write()
    failed = report.failed()
    print(
        f"{len(report.checks) - failed} passed, {failed} failed in "
        f"{time.monotonic() - report.started:.0f} s; results in {out}, logs in {logs}",
        flush=True,
    )
    return min(failed, 100) if finished else 124


if __name__ == "__main__":
    sys.exit(main())
