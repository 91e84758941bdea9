#!/usr/bin/env python
"""DPO step throughput and MFU of a Llama-style ~1B model (random init) on one CUDA GPU.

    python scripts/gpu_bench.py                               # bf16, TE spec when it imports
    python scripts/gpu_bench.py --reference precomputed --recompute selective
    python scripts/gpu_bench.py --allow-cpu --tiny --steps 2  # smoke test of the script on CPU

The model is Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads / 8 KV heads, SwiGLU FFN 8192,
vocab 128,256, tied embeddings, RoPE theta 500,000; 1.24 B parameters), randomly initialised, in
bf16 with fp32 main weights (megatron-core's mixed-precision optimizer). The pairs are synthetic,
with prompt and completion lengths drawn over a wide range like real preference data.

Reported: real (non-pad) tokens per second, padded fraction, step time (median after warm-up),
peak GPU memory, and MFU = model FLOPs / (step time x peak bf16 FLOP/s) where model FLOPs per
step = (3 x forward for the policy's forward+backward + 1 x forward for the reference, or 3 x
when the reference is precomputed) over the real tokens; forward FLOPs per token follow
Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters", eq. 3
without the backward factor): 2 x (transformer + LM-head weights) + 4 x layers x hidden x context.
The step-0 loss must be ln 2 (policy == reference) or the script exits non-zero.
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

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Dense bf16 peak (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0,
                    "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0, "A6000": 155.0}

LLAMA_1B = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                num_query_groups=8, vocab_size=128256, rotary_base=500000.0,
                max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, vocab_size=512, rotary_base=10000.0,
            max_position_embeddings=1024, tie_word_embeddings=True)


def forward_flops_per_token(layers: int, hidden: int, ffn: int, heads: int, groups: int,
                            vocab: int, context: float) -> float:
    """Forward FLOPs of one token (multiply-add = 2 FLOPs).

    Linear layers: 2 x weights (q, o: h^2 each; k, v: h^2 x groups/heads each; SwiGLU: 3 h ffn;
    LM head: h V). Attention scores and weighted sum: 2 x 2 x hidden x context per layer, with
    ``context`` the number of keys the token attends to (Narayanan et al. 2021 count the full
    sequence; a causal token attends to half of it on average).
    Example: Llama-3.2-1B, context 0 -> 2 x (16 x 60.8M + 262.7M) = 2.47 GFLOP.
    """
    kv = hidden * groups // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn
    return 2.0 * (layers * per_layer + hidden * vocab) + 4.0 * layers * hidden * context


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


def bench_config(args, shape: dict, cuda: bool):
    """The engine's config for the benchmark: random init, one rank, sigmoid DPO, constant LR,
    no checkpoints, synthetic pairs in order (the data comes in directly, no tokenizer)."""
    import tempfile

    from dpo_megatron.config import config_from_mapping

    out_dir = os.path.dirname(os.path.abspath(args.out))
    return config_from_mapping({
        "run_dir": tempfile.mkdtemp(prefix="gpu_bench_", dir=out_dir),
        "parallel": {"backend": args.backend},
        "model": {**shape, "params_dtype": "bfloat16" if cuda else "float32",
                  "transformer_impl": args.transformer_impl,
                  "local_attention": args.local_attention,
                  "recompute_granularity": args.recompute or None,
                  "recompute_method": "uniform" if args.recompute == "full" else None,
                  "recompute_num_layers": 1 if args.recompute == "full" else None},
        "data": {"shuffle": False},
        "loss": {"name": "sigmoid", "beta": 0.1},
        "train": {"lr": 1e-6, "lr_decay_style": "constant", "train_iters": args.steps,
                  "global_batch_size": args.global_batch_size,
                  "micro_batch_size": args.micro_batch_size, "seed": args.seed,
                  "use_distributed_optimizer": args.distributed_optimizer},
        "packing": {"enabled": args.packing},
        "reference": {"mode": args.reference, "offload": args.offload_reference,
                      "cache_dir": os.path.join(out_dir, ".gpu_bench_reference")},
        "checkpoint": {"save_interval": 0},
        "logging": {"tensorboard": False},
    }, check=False)


def peak_tflops(name: str, override: float) -> float:
    if override:
        return override
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="pairs")
    parser.add_argument("--global-batch-size", type=int, default=16, help="pairs per step")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--reference", default="model", choices=["model", "precomputed"])
    parser.add_argument("--offload-reference", action="store_true")
    parser.add_argument("--packing", action="store_true", help="local spec only")
    parser.add_argument("--transformer-impl", default="auto",
                        choices=["auto", "local", "transformer_engine"])
    parser.add_argument("--recompute", default="", choices=["", "selective", "full"])
    parser.add_argument("--local-attention", default="sdpa",
                        help="core attention of the local spec (model.local_attention)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="gloo runs on the host even on a CUDA machine")
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                        default=True, help="megatron-core's distributed optimizer (default on)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="override the GPU's dense bf16 peak (TFLOP/s)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (smoke test)")
    parser.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="runs/gpu_bench.json",
                        help="result JSON (the precomputed-reference cache goes next to it)")
    args = parser.parse_args(argv)

    import torch

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --allow-cpu --tiny for a smoke test",
              file=sys.stderr)
        return 2

    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    shape = TINY if args.tiny else LLAMA_1B
    cfg = bench_config(args, shape, cuda)
    pairs = synthetic_pairs(args.global_batch_size * args.steps, shape["vocab_size"],
                            args.max_length, args.seed)
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
        records.append({"time_s": time.perf_counter() - w0, "real_tokens": batch.real_tokens,
                        "computed_tokens": sum(mb.tokens.numel() for mb in batch.micro_batches),
                        "seq_length": batch.seq_length, "loss": out.metrics["loss"]})
        print(f"step {step}: loss {out.metrics['loss']:.6f} time {records[-1]['time_s']:.3f} s "
              f"seq {batch.seq_length}", flush=True)

    timed = records[args.warmup:] or records
    step_time = statistics.median(r["time_s"] for r in timed)
    real = sum(r["real_tokens"] for r in timed) / len(timed)
    mean_context = statistics.mean(r["seq_length"] for r in timed) / 2  # causal: half on average
    s = shape
    fwd = forward_flops_per_token(s["num_layers"], s["hidden_size"], s["ffn_hidden_size"],
                                  s["num_attention_heads"], s["num_query_groups"],
                                  s["vocab_size"], mean_context)
    passes = 3 + (1 if args.reference == "model" else 0)
    achieved = passes * fwd * real / step_time
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(name, args.peak_tflops) * 1e12
    result = {
        "device": name, "transformer_engine": te, "params": n_params,
        "settings": vars(args), "step_time_median_s": step_time,
        "real_tokens_per_s": real / step_time,
        "padded_fraction": 1 - sum(r["real_tokens"] for r in timed)
        / sum(r["computed_tokens"] for r in timed),
        "model_tflops_per_s": achieved / 1e12, "mfu": achieved / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "precompute_s": precompute_s, "step0_loss": records[0]["loss"], "steps": records,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "settings")},
                     indent=1))
    if abs(records[0]["loss"] - math.log(2)) > 1e-3:
        print(f"step-0 loss {records[0]['loss']} != ln 2", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
