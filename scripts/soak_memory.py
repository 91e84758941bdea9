#!/usr/bin/env python
"""Whether a long run's memory stays flat: many steps of a tiny DPO run through the launcher.

    .venv/bin/python scripts/soak_memory.py --steps 1000 --data-parallel-size 2 --save-interval 100

Runs ``scripts/pretrain_dpo.sh`` on ``configs/tiny_cpu.yaml`` (a 2-layer model on the real
dpo_en_demo pairs, many epochs of them) with a checkpoint every ``--save-interval`` steps, then
reads the run's ``metrics.jsonl``: ``memory/current_gib`` at each step is the largest resident
memory of any rank (``parallel.device.memory_stats``; device memory on a GPU). The first
``--save-interval`` steps are warm-up (allocator pools, the first save's writer, the
checkpointing modules' caches); over the rest it reports the least-squares slope in MiB per 1,000
steps and the growth from the warm-up's end to the last step (the medians of the first and last
tenth of the measured steps, so one allocation spike does not decide). Exit status 1 when the
growth exceeds ``--max-growth-mib``. A leak of one tensor a step shows as a steady slope; the
figures of the last soak are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dpo_megatron.utils.files import write_text_atomic

REPO = Path(__file__).resolve().parents[1]

MIB_PER_GIB = 1024.0


def memory_trend(records: list[dict], warmup_steps: int) -> dict:
    """The memory trend of a run's per-step records (``metrics.jsonl`` rows with ``step`` and
    ``memory/current_gib``) after its first ``warmup_steps`` steps.

    Returns ``{"steps": n, "first_mib", "last_mib", "growth_mib", "slope_mib_per_1000_steps"}``:
    medians (MiB) of the first and the last tenth of the measured steps (at least one step each),
    their difference, and the least-squares slope of memory against step.

    Raises:
        ValueError: fewer than 2 measured steps after the warm-up.
    """
    points = [
        (int(r["step"]), float(r["memory/current_gib"]) * MIB_PER_GIB)
        for r in records
        if "memory/current_gib" in r and int(r.get("step", 0)) > warmup_steps
    ]
    if len(points) < 2:
        raise ValueError(f"{len(points)} steps after a warm-up of {warmup_steps}: need 2 or more")
    tenth = max(1, len(points) // 10)
    first = statistics.median(m for _, m in points[:tenth])
    last = statistics.median(m for _, m in points[-tenth:])
    steps = [s for s, _ in points]
    mean_step = statistics.fmean(steps)
    mean_mib = statistics.fmean(m for _, m in points)
    spread = sum((s - mean_step) ** 2 for s in steps)
    slope = sum((s - mean_step) * (m - mean_mib) for s, m in points) / spread if spread else 0.0
    return {
        "steps": len(points),
        "first_mib": first,
        "last_mib": last,
        "growth_mib": last - first,
        "slope_mib_per_1000_steps": slope * 1000,
    }


def main() -> int:
    if str(REPO) not in sys.path:  # run as a file: the package from this checkout
        sys.path.insert(0, str(REPO))
    from dpo_megatron.training.metrics_log import split_records

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--save-interval", type=int, default=100, help="also the warm-up, in steps")
    p.add_argument("--max-growth-mib", type=float, default=64.0)
    p.add_argument("--run-dir", type=Path, help="default: a temporary folder, removed after")
    p.add_argument("--json", type=Path, help="write the trend here too")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        cmd = [
            str(REPO / "scripts" / "pretrain_dpo.sh"),
            "--config",
            str(REPO / "configs" / "tiny_cpu.yaml"),
            f"run_dir={run_dir}",
            f"train.train_iters={args.steps}",
            "train.log_interval=1",
            f"checkpoint.save_interval={args.save_interval}",
            f"parallel.data_parallel_size={args.data_parallel_size}",
        ]
        print("soak:", " ".join(cmd), flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        records = list(split_records(str(run_dir / "metrics.jsonl"), "train"))
        trend = memory_trend(records, args.save_interval)
    trend.update(steps_run=args.steps, data_parallel_size=args.data_parallel_size)
    print(
        f"soak: {trend['steps']} steps after {args.save_interval} of warm-up: "
        f"{trend['first_mib']:.1f} -> {trend['last_mib']:.1f} MiB (largest rank's resident "
        f"memory), growth {trend['growth_mib']:+.1f} MiB, slope "
        f"{trend['slope_mib_per_1000_steps']:+.2f} MiB per 1000 steps"
    )
    if args.json:
        write_text_atomic(args.json, json.dumps(trend, indent=2) + "\n")
    if trend["growth_mib"] > args.max_growth_mib:
        print(f"soak: growth above --max-growth-mib {args.max_growth_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
