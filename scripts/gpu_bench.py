#!/usr/bin/env python
"""DPO step throughput and MFU of a Llama-style ~1B model (random init) on one CUDA GPU.

    python scripts/gpu_bench.py                               # bf16, TE spec when it imports
    python scripts/gpu_bench.py --reference precomputed --recompute selective
    python scripts/gpu_bench.py --packing --share-prompt --local-attention flex   # no TE needed
    python scripts/gpu_bench.py --allow-cpu --tiny --steps 2  # smoke test of the script on CPU

The model is Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads / 8 KV heads, SwiGLU FFN 8192,
vocab 128,256, tied embeddings, RoPE theta 500,000; 1.24 B parameters), randomly initialised, in
bf16 with fp32 main weights (megatron-core's mixed-precision optimizer). The pairs are synthetic,
with prompt and completion lengths drawn over a wide range like real preference data.

Reported: real (non-pad) tokens per second (every sequence counted, as TRL counts them),
padded fraction, step time (median after warm-up), peak GPU memory beside the layout planner's
prediction of it (``dpo_megatron.planning``), and MFU = model FLOPs /
(step time x peak bf16 FLOP/s) where model FLOPs per step = (3 x forward for the policy's
forward+backward + 1 x forward for the reference, or 3 x when the reference is precomputed);
forward FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on
GPU Clusters", eq. 3 without the backward factor) for the work this engine does
(``pair_forward_flops``: layers over the tokens it runs, a shared prompt once; the LM head over
completion tokens; attention over the (query, key) pairs each token sees). The peak is the
datasheet's dense bf16 figure of the exact SKU (``peak_tflops``); for a GPU not in the table MFU
is ``null`` and ``sku`` names the GPU. The step-0 loss must be ln 2 (policy == reference) or
the script exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dpo_megatron.planning.flops import (  # noqa: E402  (re-exported: gpu_check, tests)
    forward_flops_per_token,
    pair_forward_flops,
)

__all__ = ["forward_flops_per_token", "pair_forward_flops", "peak_tflops", "run_config"]

LLAMA_1B = dict(
    num_layers=16,
    hidden_size=2048,
    ffn_hidden_size=8192,
    num_attention_heads=32,
    num_query_groups=8,
    vocab_size=128256,
    rotary_base=500000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=512,
    rotary_base=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def synthetic_pairs(n: int, vocab: int, max_length: int, seed: int):
    """n pairs with prompt 16..max/2 tokens and completions 8..max/2 (cut to max_length)."""
    import random

    from dpo_megatron.data import PreferencePair

    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        p = rng.randint(16, max_length // 2)
        c = min(rng.randint(8, max_length // 2), max_length - p)
        r = min(rng.randint(8, max_length // 2), max_length - p)
        ids = lambda k: tuple(rng.randrange(3, vocab) for _ in range(k))  # noqa: E731
        pairs.append(PreferencePair(ids(p), ids(c - 1) + (2,), ids(r - 1) + (2,)))
    return pairs


def run_config(
    run_dir: str,
    shape: dict,
    *,
    steps: int,
    global_batch_size: int,
    micro_batch_size: int,
    seed: int,
    backend: str = "auto",
    params_dtype: str = "auto",
    lr: float = 1e-6,
    packing: bool = False,
    share_prompt: bool = False,
    local_attention: str = "auto",
    transformer_impl: str = "auto",
    recompute: str = "",
    reference: str = "model",
    offload_reference: bool = False,
    cache_dir: str = "",
    context_parallel_size: int = 1,
    distributed_optimizer: bool = True,
    extra: dict[str, dict[str, Any]] | None = None,
):
    """The engine's config for a one-replica run on pairs given directly (no tokenizer): sigmoid
    DPO (beta 0.1), constant LR, pairs in order, no checkpoints or TensorBoard unless ``extra``
    says so. Used by this benchmark and by ``scripts/gpu_check.py``.

    Args:
        run_dir: the run folder.
        shape: ``model.*`` architecture keys (e.g. :data:`LLAMA_1B`).
        steps, global_batch_size, micro_batch_size, seed: ``train.*`` (batches in pairs).
        backend: ``parallel.backend``; params_dtype: ``model.params_dtype``; the rest as the
            same-named command-line options of this script.
        extra: further keys by section, merged over these (``{"model": {"load": DIR}}``,
            ``{"lora": {"enabled": True}}``, ``{"checkpoint": {"save_interval": 2}}``).

    Raises:
        ValueError: a key the config tree does not have (``config_from_mapping``).
    """
    from dpo_megatron.config import config_from_mapping

    mapping: dict[str, Any] = {
        "run_dir": run_dir,
        "parallel": {"backend": backend, "context_parallel_size": context_parallel_size},
        "model": {
            **shape,
            "params_dtype": params_dtype,
            "transformer_impl": transformer_impl,
            "local_attention": local_attention,
            "recompute_granularity": recompute or None,
            "recompute_method": "uniform" if recompute == "full" else None,
            "recompute_num_layers": 1 if recompute == "full" else None,
        },
        "data": {"shuffle": False},
        "loss": {"name": "sigmoid", "beta": 0.1},
        "train": {
            "lr": lr,
            "lr_decay_style": "constant",
            "train_iters": steps,
            "global_batch_size": global_batch_size,
            "micro_batch_size": micro_batch_size,
            "seed": seed,
            "use_distributed_optimizer": distributed_optimizer,
        },
        "packing": {"enabled": packing or share_prompt, "share_prompt": share_prompt},
        "reference": {"mode": reference, "offload": offload_reference, "cache_dir": cache_dir},
        "checkpoint": {"save_interval": 0},
        "logging": {"tensorboard": False},
    }
    for section, values in (extra or {}).items():
        mapping.setdefault(section, {}).update(values)
    return config_from_mapping(mapping, check=False)


def bench_config(args, shape: dict, cuda: bool):
    """:func:`run_config` for this script's options: random init, bf16 on CUDA (fp32 on the
    CPU), lr 1e-6, the precomputed-reference cache next to ``--out``."""
    import tempfile

    out_dir = os.path.dirname(os.path.abspath(args.out))
    return run_config(
        tempfile.mkdtemp(prefix="gpu_bench_", dir=out_dir),
        shape,
        steps=args.steps,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        backend=args.backend,
        params_dtype="bfloat16" if cuda else "float32",
        packing=args.packing,
        share_prompt=args.share_prompt,
        local_attention=args.local_attention,
        transformer_impl=args.transformer_impl,
        recompute=args.recompute,
        reference=args.reference,
        offload_reference=args.offload_reference,
        cache_dir=os.path.join(out_dir, ".gpu_bench_reference"),
        context_parallel_size=args.context_parallel_size,
        distributed_optimizer=args.distributed_optimizer,
    )


def peak_tflops(name: str, override: float = 0.0) -> tuple[float | None, str]:
    """The dense bf16 peak of the GPU ``torch.cuda.get_device_name()`` calls ``name``
    (``dpo_megatron.planning.hardware``: exact per board, never by substring: ``NVIDIA H100
    PCIe`` is 756.5, ``NVIDIA H100 80GB HBM3`` (SXM) 989.4).

    Args:
        name: the device name.
        override: TFLOP/s given by the user (``--peak-tflops``); > 0 wins over the table.

    Returns:
        (TFLOP/s, SKU) such as ``(989.4, "H200 SXM")``; ``(override, "given: NAME")`` with an
        override; ``(None, "unknown GPU 'NAME'")`` for a name not in the table (MFU is then
        reported as unknown).
    """
    from dpo_megatron.planning.hardware import find_accelerator

    if override > 0:
        return override, f"given: {name}"
    found = find_accelerator(name)
    if found is None:
        return None, (
            f"unknown GPU {name!r} (not in dpo_megatron.planning.hardware.ACCELERATORS; pass "
            "--peak-tflops)"
        )
    return found.bf16_tflops, found.sku


def planned_peak(trainer, pairs, seq_length: int) -> float:
    """The layout planner's peak (GiB) of a training step of this run, as
    ``torch.cuda.max_memory_allocated`` counts it after set-up (``dpo_megatron.planning``): its
    config, every sequence ``seq_length`` long (the longest step's padded rows), prompts as long
    as the pairs' on average."""
    import dataclasses

    from dpo_megatron.losses import build_loss
    from dpo_megatron.parallel.device import is_host
    from dpo_megatron.planning.from_config import numerics_for, workload_for
    from dpo_megatron.planning.hardware import ACCELERATORS, Cluster
    from dpo_megatron.planning.memory import stage_memory

    cfg = dataclasses.replace(
        trainer.cfg, data=dataclasses.replace(trainer.cfg.data, max_length=seq_length)
    )
    prompt = sum(len(p.prompt_ids) for p in pairs) / sum(
        len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs
    )
    loss_fn = build_loss(cfg.loss)
    model = trainer.model_config
    cluster = Cluster(1, 1, ACCELERATORS["h100"], host=is_host())
    workload = workload_for(cfg, loss_fn, model, cfg.train.micro_batch_size, prompt, len(pairs))
    parallel = dataclasses.replace(cfg.parallel, data_parallel_size=1)
    memory = stage_memory(
        model,
        parallel,
        workload,
        numerics_for(model, cluster),
        0,
        cfg.train.use_distributed_optimizer,
        cfg.train.optimizer,
    )
    return memory.phases["training"] / 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="CP ranks splitting each sequence (launch that many ranks with "
        "torchrun --nproc-per-node N; tokens/s count the replica's "
        "step, MFU is per GPU)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="pairs")
    parser.add_argument("--global-batch-size", type=int, default=16, help="pairs per step")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--reference", default="model", choices=["model", "precomputed"])
    parser.add_argument("--offload-reference", action="store_true")
    parser.add_argument(
        "--packing",
        action="store_true",
        help="padding-free packing (local kernels; THD with transformer-engine)",
    )
    parser.add_argument(
        "--share-prompt",
        action="store_true",
        help="one [prompt | chosen | rejected] unit per pair (implies --packing)",
    )
    parser.add_argument(
        "--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"]
    )
    parser.add_argument("--recompute", default="", choices=["", "selective", "full"])
    parser.add_argument(
        "--local-attention",
        default="auto",
        choices=["auto", "sdpa", "flex", "megatron"],
        help="core attention of the local spec (model.local_attention; auto: "
        "FlexAttention on CUDA)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="gloo runs on the host even on a CUDA machine",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="megatron-core's distributed optimizer (default on)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="override the GPU's dense bf16 peak (TFLOP/s)",
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (smoke test)")
    parser.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--out",
        default="runs/gpu_bench.json",
        help="result JSON (the precomputed-reference cache goes next to it)",
    )
    args = parser.parse_args(argv)

    import torch

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(
            "no CUDA device: run on a GPU machine, or pass --allow-cpu --tiny for a smoke test",
            file=sys.stderr,
        )
        return 2

    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    shape = TINY if args.tiny else LLAMA_1B
    cfg = bench_config(args, shape, cuda)
    pairs = synthetic_pairs(
        args.global_batch_size * args.steps, shape["vocab_size"], args.max_length, args.seed
    )
    trainer = Trainer(cfg, data=RunData(pairs, [], 2))
    from dpo_megatron.models.transformer_config import use_transformer_engine

    te = use_transformer_engine(cfg.model.transformer_impl)
    n_params = sum(p.numel() for c in trainer.policy for p in c.parameters())
    precompute_s = trainer.timings["reference_setup_s"]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    records = []
    for step in range(args.steps):
        sync()
        w0 = time.perf_counter()
        out, batch = trainer.train_step()
        sync()
        step_pairs = [pairs[i] for indices in batch.item_indices for i in indices]
        records.append(
            {
                "time_s": time.perf_counter() - w0,
                "real_tokens": batch.real_tokens,
                "model_tokens": batch.computed_tokens,
                # every CP rank holds 1 / CP of each micro-batch's positions
                "computed_tokens": args.context_parallel_size
                * sum(mb.tokens.numel() for mb in batch.micro_batches),
                "forward_flops": sum(
                    pair_forward_flops(
                        shape,
                        len(p.prompt_ids),
                        len(p.chosen_ids),
                        len(p.rejected_ids),
                        args.share_prompt,
                    )
                    for p in step_pairs
                ),
                "seq_length": batch.seq_length,
                "loss": out.metrics["loss"],
            }
        )
        print(
            f"step {step}: loss {out.metrics['loss']:.6f} time {records[-1]['time_s']:.3f} s "
            f"seq {batch.seq_length}",
            flush=True,
        )

    timed = records[args.warmup :] or records
    step_time = statistics.median(r["time_s"] for r in timed)
    real = sum(r["real_tokens"] for r in timed) / len(timed)
    # This rank's micro-batches are the whole step (one rank, or the CP ranks of one replica,
    # each computing 1 / CP of it). Policy forward + backward = 3 forwards, plus the reference
    # forward when it runs each step.
    passes = 3 + (1 if args.reference == "model" else 0)
    fwd = sum(r["forward_flops"] for r in timed) / len(timed)
    achieved = passes * fwd / step_time / args.context_parallel_size
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak, sku = peak_tflops(name, args.peak_tflops)
    result = {
        "device": name,
        "transformer_engine": te,
        "params": n_params,
        "settings": vars(args),
        "step_time_median_s": step_time,
        "real_tokens_per_s": real / step_time,
        "model_tokens_per_real_token": sum(r["model_tokens"] for r in timed)
        / sum(r["real_tokens"] for r in timed),
        "padded_fraction": 1
        - sum(r["model_tokens"] for r in timed) / sum(r["computed_tokens"] for r in timed),
        # None when the GPU is not in the peak table: ``sku`` then names it
        "model_tflops_per_s": achieved / 1e12,
        "mfu": achieved / (peak * 1e12) if peak else None,
        "peak_tflops": peak,
        "sku": sku,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "planned_peak_gib": planned_peak(trainer, pairs, max(r["seq_length"] for r in records)),
        "precompute_s": precompute_s,
        "step0_loss": records[0]["loss"],
        "steps": records,
    }
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return 0
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "settings")}, indent=1))
    if abs(records[0]["loss"] - math.log(2)) > 1e-3:
        print(f"step-0 loss {records[0]['loss']} != ln 2", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
