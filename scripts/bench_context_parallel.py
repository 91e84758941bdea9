#!/usr/bin/env python
"""Peak memory per rank under context parallelism: one long pair, CP 1, 2, 4 (CPU, gloo).

    .venv/bin/python scripts/bench_context_parallel.py --cp 1,2,4 --length 8192 \\
        --out runs/bench_cp.json

For each CP size the real ``Trainer`` runs on CP gloo ranks (``torch.distributed.run``, one
torch thread per rank), on one synthetic pair whose sequences are ``--length`` tokens (prompt
half, completions the other half), a small random model (reference model each step, Adam, fp32).
Step 1 is a warm-up (it allocates the optimizer state); step 2 is measured. Per rank:

* ``peak_rss_gib``: the process's peak resident memory over the whole run (``ru_maxrss`` or the
  sampled peak);
* ``step_rss_gib``: the highest RSS sampled during step 2 minus the RSS just before it;
* ``step_in_use_gib``: the same for the C allocator's bytes in use (glibc ``mallinfo2``), which
  does not count freed pages the allocator keeps: the activation and attention memory of the
  step (hidden states, saved tensors, gathered keys/values, logits of the scored tokens,
  gradients in flight). Weights, gradient buffers and Adam state exist before the step and are
  not in it.

The step's loss (ln 2 at step 1) and gradient norm are reported with each run: they must agree
across CP sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "scripts")):
    if path not in sys.path:
        sys.path.insert(0, path)

MODEL = dict(
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=512,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=512,
    tie_word_embeddings=False,
)


def _worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from bench_dpo import PeakRSS

    from dpo_megatron.config import config_from_mapping
    from dpo_megatron.data import PreferencePair
    from dpo_megatron.parallel.host_malloc import malloc_in_use
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    torch.set_num_threads(1)
    half = args.length // 2
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(3, MODEL["vocab_size"], (n,), generator=g).tolist())  # noqa: E731
    pair = PreferencePair(
        ids(half), ids(args.length - half - 1) + (2,), ids(args.length - half - 1) + (2,)
    )
    cfg = config_from_mapping(
        {
            "run_dir": args.worker_run_dir,
            "parallel": {"context_parallel_size": args.worker_cp, "backend": "gloo"},
            "model": MODEL,
            "loss": {"name": "sigmoid", "beta": 0.1},
            "train": {
                "micro_batch_size": 1,
                "global_batch_size": 1,
                "train_iters": 2,
                "lr": 1e-4,
                "lr_decay_style": "constant",
                "seed": 1,
            },
            "checkpoint": {"save_interval": 0},
            "logging": {"tensorboard": False},
        },
        check=False,
    )
    trainer = Trainer(cfg, data=RunData([pair], [], 0))
    first, _ = trainer.train_step()
    rss_before = PeakRSS()._proc.memory_info().rss
    in_use_before = malloc_in_use()
    sampler = PeakRSS(interval=0.01)
    out, batch = trainer.train_step()
    sampler.stop_sampling()
    record = {
        "rank": dist.get_rank(),
        "local_tokens_per_row": batch.micro_batches[0].tokens.shape[1],
        "peak_rss_gib": max(sampler.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        / 2**30,
        "step_rss_gib": (sampler.peak - rss_before) / 2**30,
        "step_in_use_gib": (sampler.peak_in_use - in_use_before) / 2**30,
        "step1_loss": first.metrics["loss"],
        "step2_loss": out.metrics["loss"],
        "step1_grad_norm": first.grad_norm,
    }
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(records))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", default="1,2,4", help="context-parallel sizes to run")
    parser.add_argument("--length", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--out", default="runs/bench_cp.json")
    parser.add_argument("--worker-cp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        _worker(args)
        return 0
    from dpo_megatron.parallel.layout import free_port

    report = {"length": args.length, "model": MODEL, "runs": {}}
    for cp in (int(c) for c in args.cp.split(",")):
        # every rank's run folder: one temporary folder, removed when the run ends
        with (
            tempfile.NamedTemporaryFile(suffix=".json") as tmp,
            tempfile.TemporaryDirectory(prefix="bench_cp_") as run_dir,
        ):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    str(cp),
                    "--master-port",
                    str(free_port()),
                    __file__,
                    "--length",
                    str(args.length),
                    "--worker-cp",
                    str(cp),
                    "--worker-out",
                    tmp.name,
                    "--worker-run-dir",
                    run_dir,
                ],
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            )
            report["runs"][cp] = json.loads(Path(tmp.name).read_text())
        worst = max(report["runs"][cp], key=lambda r: r["step_in_use_gib"])
        print(
            f"CP {cp}: per rank peak RSS "
            f"{[round(r['peak_rss_gib'], 3) for r in report['runs'][cp]]} GiB, step in use "
            f"{[round(r['step_in_use_gib'], 3) for r in report['runs'][cp]]} GiB (max "
            f"{worst['step_in_use_gib']:.3f}), loss {worst['step1_loss']:.6f}, grad norm "
            f"{worst['step1_grad_norm']:.6f}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
