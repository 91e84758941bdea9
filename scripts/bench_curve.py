#!/usr/bin/env python
"""The cost curve: tokens per CPU-second and peak memory against max_length and pairs per step,
this engine's default and TRL's DPOTrainer side by side in one run.

    .venv/bin/python scripts/bench_curve.py          # docs/bench_curve.{json,md}, two PNGs
    .venv/bin/python scripts/bench_curve.py --from-json docs/bench_curve.json   # redraw only

Each point is two fresh child processes of ``scripts/bench_dpo.py`` (``trl`` and ``engine``: the
same pairs, order, hyper-parameters and measurement; see that script) on the 4-layer cut of
SmolLM2-135M. Two axes: ``max_length`` (``--lengths``, at ``--length-pairs`` pairs per step;
``max_prompt_length`` = half of it) and pairs per step (``--pairs``, at ``--pairs-length``).
Writes the JSON, a Markdown table and one PNG per axis (``--plots``, drawn with matplotlib:
``pip install -e .[bench]``): real tokens per CPU-second and peak RSS, both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dpo  # noqa: E402  (the sibling script: one measurement harness)

RUNS = ("trl", "engine")


def points(args) -> list[tuple[str, int, int]]:
    """(axis, max_length, pairs per step) of every point, the length axis first."""
    out = [("max_length", n, args.length_pairs) for n in _ints(args.lengths)]
    out += [("pairs_per_step", args.pairs_length, p) for p in _ints(args.pairs)]
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure(args, model_path: str, max_length: int, pairs_per_step: int, run: str) -> dict:
    """One child run of bench_dpo at this point."""
    spec = {
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs_per_step": pairs_per_step,
        "micro_batch_size": pairs_per_step,
        "max_length": max_length,
        "max_prompt_length": max_length // 2,
        "beta": 0.1,
        "lr": 1e-6,
        "seed": 1234,
        "threads": args.threads,
        "recompute": "",
        "pairs": pairs_per_step * args.steps,
        "model": args.model,
        "model_path": model_path,
        "run": run,
    }
    return bench_dpo._child(spec)


def table(report: dict) -> str:
    """The Markdown table: one row per point and run, engine / TRL ratios per point."""
    lines = [
        "| axis | max_length | pairs / step | run | real tokens / step | real tok/s (CPU) | "
        "real tok/s (wall) | "
        "peak RSS (GiB) | padded fraction | step-0 loss | engine / TRL tok/s (CPU) | "
        "engine / TRL peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        r = p["results"]
        both = all(k in r for k in RUNS)
        for run in RUNS:
            if run not in r:
                continue
            x = r[run]
            speed = memory = ""
            if both and run == "engine":
                q = bench_dpo.ratios(r["engine"], r["trl"])
                speed, memory = f"{q['real_tokens_per_cpu_s']:.2f}x", f"{q['peak_rss']:.2f}x"
            lines.append(
                f"| {p['axis']} | {p['max_length']} | {p['pairs_per_step']} | {run} | "
                f"{x['real_tokens_per_step']:.0f} | "
                f"{x['real_tokens_per_cpu_s']:.1f} | {x['real_tokens_per_s']:.1f} | "
                f"{x['peak_rss_bytes'] / 2**30:.2f} | {x['padded_fraction']:.3f} | "
                f"{x['step0']['loss']:.6f} | {speed} | {memory} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, axis: str, path: str) -> None:
    """One PNG: real tokens per CPU-second (left) and peak RSS (right) against ``axis``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for run in RUNS:
        pts = [p for p in report["points"] if p["axis"] == axis and run in p["results"]]
        xs = [p[axis] for p in pts]
        left.plot(xs, [p["results"][run]["real_tokens_per_cpu_s"] for p in pts], "o-", label=run)
        right.plot(xs, [p["results"][run]["peak_rss_bytes"] / 2**30 for p in pts], "o-", label=run)
    for ax, what in ((left, "real tokens / CPU-second"), (right, "peak RSS (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(axis.replace("_", " "))
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.legend()
    title = f"DPO on {report['settings']['model']}, engine default vs TRL, 1 thread"
    if axis == "max_length":
        title += f", {report['settings']['length_pairs']} pairs / step"
    else:
        title += f", max_length {report['settings']['pairs_length']}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-4l", help="a bench_dpo model name")
    parser.add_argument("--lengths", default="256,512,1024,2048", help="max_length axis")
    parser.add_argument("--length-pairs", type=int, default=2, help="pairs / step there")
    parser.add_argument("--pairs", default="2,4,8,16", help="pairs-per-step axis")
    parser.add_argument("--pairs-length", type=int, default=256, help="max_length there")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/bench_curve.json")
    parser.add_argument("--markdown", default="docs/bench_curve.md")
    parser.add_argument("--plots", default="docs/bench_curve", help="PNG path prefix")
    parser.add_argument("--from-json", default="", help="redraw table and PNGs from this JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        _write(report, args)
        return 0

    path = bench_dpo.model_folder(args.model)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": {**vars(args)},
        "machine": bench_dpo.machine(),
        "points": [],
    }
    started = time.time()
    done: dict[tuple[int, int], dict] = {}  # a point on both axes is measured once
    for axis, max_length, pairs_per_step in points(args):
        if (max_length, pairs_per_step) in done:
            report["points"].append({**done[(max_length, pairs_per_step)], "axis": axis})
            continue
        point = {
            "axis": axis,
            "max_length": max_length,
            "pairs_per_step": pairs_per_step,
            "results": {},
        }
        report["points"].append(point)
        done[(max_length, pairs_per_step)] = point
        for run in RUNS:
            t0 = time.time()
            try:
                r = measure(args, path, max_length, pairs_per_step, run)
            except RuntimeError as e:  # e.g. fewer pairs fit this max_length than asked
                point.setdefault("errors", {})[run] = str(e)[-400:]
                print(f"{axis} {max_length} x {pairs_per_step} {run}: failed", flush=True)
                continue
            point["results"][run] = r
            print(
                f"{axis:14s} len {max_length:5d} pairs {pairs_per_step:3d} {run:7s} "
                f"{r['real_tokens_per_cpu_s']:8.1f} tok/s cpu  rss "
                f"{r['peak_rss_bytes'] / 2**30:.2f} GiB  loss0 {r['step0']['loss']:.6f} "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
            Path(args.out).write_text(json.dumps(report, indent=1))
    report["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["total_s"] = time.time() - started
    Path(args.out).write_text(json.dumps(report, indent=1))
    _write(report, args)
    return 0


def _write(report: dict, args) -> None:
    Path(args.markdown).write_text(table(report))
    for axis in ("max_length", "pairs_per_step"):
        if sum(p["axis"] == axis and bool(p["results"]) for p in report["points"]) > 1:
            plot(report, axis, f"{args.plots}_{axis}.png")  # a curve needs two points
    print(table(report))


if __name__ == "__main__":
    sys.exit(main())
