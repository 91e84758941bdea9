#!/usr/bin/env python
"""Where the peak resident memory of one DPO step goes (CPU, fp32, world size 1).

    .venv/bin/python scripts/memory_breakdown.py --engine engine     # padded, reference model
    .venv/bin/python scripts/memory_breakdown.py --engine engine+shared+precomputed \
        --model smollm2

Runs the engine of ``scripts/bench_dpo.py`` (same model, pairs, settings and ``ENGINES`` table)
for a few steps in this process and reports, in GiB:

* the process before the engine (interpreter, torch, megatron-core, tokenizer, the pairs);
* tensors the engine holds for the whole run: policy weights, reference weights, megatron-core
  DDP buffers (gradients; parameters too with the distributed optimizer), Adam state;
* activations saved for backward during the policy's forward (``torch.autograd.graph.
  saved_tensors_hooks``, each storage counted once, parameters excluded), split by what they are
  (vocabulary-wide logits, MLP, attention, hidden-size tensors);
* the peak RSS of a step (sampled every 20 ms, and ``ru_maxrss``) and what the above leave of it
  (transients: logit gradients, the reference forward, allocator slack).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from dpo_megatron.utils.files import write_json_atomic  # noqa: E402

GIB = 2**30


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _storage_bytes(tensors) -> tuple[int, set]:
    """Bytes of the distinct storages behind ``tensors`` and their addresses."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total, seen


class SavedActivations:
    """Records every tensor autograd saves for backward (storage counted once), by kind."""

    def __init__(self, exclude: set, vocab_shard: int, hidden: int, ffn: int):
        import torch

        self.exclude, self.seen = exclude, set()
        self.by_kind: dict[str, int] = {}
        self._kinds = {
            vocab_shard: "logits (vocabulary-wide)",
            ffn: "MLP",
            2 * ffn: "MLP",
            hidden: "hidden-size (norms, residual, projections)",
        }
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in self.exclude and ptr not in self.seen and s.nbytes() > 0:
            self.seen.add(ptr)
            last = t.shape[-1] if t.dim() else 0
            kind = self._kinds.get(last, "attention (q/k/v, outputs) and other")
            self.by_kind[kind] = self.by_kind.get(kind, 0) + s.nbytes()
        return t

    def __enter__(self):
        # The model's forward runs inside the engine's own saved-tensor hooks
        # (utils.saved_activations.recompute_marked), which replace this block's for the layers:
        # count there what the engine keeps (a tensor), not what it makes again (a recipe).
        import torch

        from dpo_megatron.utils import saved_activations

        self._engine_pack = saved_activations._pack

        def pack(tensor):
            kept = self._engine_pack(tensor)
            return self._pack(kept) if isinstance(kept, torch.Tensor) else kept

        saved_activations._pack = pack
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        from dpo_megatron.utils import saved_activations

        saved_activations._pack = self._engine_pack
        self._hooks.__exit__(*exc)


def breakdown(spec: dict) -> dict:
    """The numbers of one engine setting (see the module docstring)."""
    import torch
    from bench_dpo import PeakRSS, bench_items, engine_config

    torch.set_num_threads(spec["threads"])
    meter = PeakRSS()
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    pairs, pad = bench_items(
        spec["pairs"], spec["max_length"], spec["max_prompt_length"], spec["objective"]
    )
    before = _rss()
    run_dir = os.path.join(spec["scratch_dir"], "engine")
    trainer = Trainer(engine_config(spec, run_dir), data=RunData(pairs, [], pad))
    after_setup = _rss()
    params = [p for c in trainer.policy for p in c.parameters()]
    policy_bytes, param_ptrs = _storage_bytes(params)
    ref_params = (
        [p for c in trainer.reference.chunks for p in c.parameters()]
        if trainer.reference is not None
        else []
    )
    reference_bytes, ref_ptrs = _storage_bytes(ref_params)
    buffers = [b for c in trainer.policy for b in getattr(c, "buffers", [])]
    grad_bytes, grad_ptrs = _storage_bytes([b.grad_data for b in buffers])
    ddp_param_bytes, _ = _storage_bytes(
        [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
    )
    model = trainer.model_config
    from dpo_megatron.models.transformer_config import padded_vocab_size

    shard = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1)
    saved = SavedActivations(
        param_ptrs | ref_ptrs | grad_ptrs, shard, model.hidden_size, model.ffn_hidden_size
    )
    steps = []
    for step in range(spec["steps"]):
        step_meter = PeakRSS()
        t0 = time.process_time()
        if step == 0:
            with saved:
                out, batch = trainer.train_step()
        else:
            out, batch = trainer.train_step()
        if spec.get("trim"):
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        steps.append(
            {
                "peak_rss": step_meter.stop_sampling(),
                "peak_malloc_in_use": step_meter.peak_in_use,
                "cpu_s": time.process_time() - t0,
                "loss": out.metrics["loss"],
                "shape": list(batch.micro_batches[0].tokens.shape),
                "model_tokens": batch.computed_tokens,
                "real_tokens": batch.real_tokens,
            }
        )
    state = (
        [
            v
            for s in trainer.optimizer.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        if hasattr(trainer.optimizer, "optimizer")
        else []
    )
    adam_bytes, _ = _storage_bytes(state)
    peak = meter.stop()
    activations = sum(saved.by_kind.values())
    held = policy_bytes + reference_bytes + grad_bytes + ddp_param_bytes + adam_bytes
    return {
        "engine": spec["run"],
        "model": spec["model"],
        "steps": steps,
        "process_before_engine": before,
        "rss_after_setup": after_setup,
        "policy_weights": policy_bytes,
        "reference_weights": reference_bytes,
        "ddp_grad_buffers": grad_bytes,
        "ddp_param_buffers": ddp_param_bytes,
        "adam_state": adam_bytes,
        "saved_activations": activations,
        "saved_by_kind": saved.by_kind,
        "peak_rss": peak,
        "transient_and_slack": peak - before - held - activations,
    }


def table(result: dict) -> str:
    """The breakdown as a Markdown table (GiB)."""
    rows = [
        (
            "process before the engine (interpreter, libraries, data)",
            result["process_before_engine"],
        ),
        ("policy weights", result["policy_weights"]),
        ("reference weights", result["reference_weights"]),
        ("DDP gradient buffers", result["ddp_grad_buffers"]),
        ("DDP parameter buffers", result["ddp_param_buffers"]),
        ("Adam state (exp_avg, exp_avg_sq)", result["adam_state"]),
    ]
    rows += [(f"saved activations: {k}", v) for k, v in sorted(result["saved_by_kind"].items())]
    rows += [
        (
            "transients (logit gradients, reference forward, allocator slack)",
            result["transient_and_slack"],
        ),
        ("**peak RSS**", result["peak_rss"]),
    ]
    lines = [
        f"{result['engine']} on {result['model']}, micro-batch shape "
        f"{result['steps'][0]['shape']}, {result['steps'][0]['model_tokens']} positions "
        f"computed for {result['steps'][0]['real_tokens']} real tokens (step 1)",
        "",
        "| component | GiB |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value / GIB:.2f} |" for name, value in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench_dpo import ENGINES, in_scratch, model_folder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="engine", choices=sorted(ENGINES))
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, smollm2-4l or an HF folder of the same tokenizer",
    )
    parser.add_argument("--objective", default="dpo", help="dpo, kto or reward (bench_dpo's)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--pairs-per-step", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--recompute", default="")
    parser.add_argument(
        "--trim",
        action="store_true",
        help="malloc_trim(0) after each step (hand freed heap pages back)",
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    spec = {
        "run": args.engine,
        "model": args.model,
        "model_path": args.model if Path(args.model).is_dir() else model_folder(args.model),
        "objective": args.objective,
        "steps": args.steps,
        "warmup": 0,
        "pairs_per_step": args.pairs_per_step,
        "micro_batch_size": args.pairs_per_step,
        "pairs": args.pairs_per_step * args.steps,
        "max_length": args.max_length,
        "max_prompt_length": args.max_prompt_length,
        "beta": 0.1,
        "lr": 1e-6,
        "seed": 1234,
        "threads": 1,
        "recompute": args.recompute,
        "trim": args.trim,
    }
    result = in_scratch(breakdown, spec)
    print(table(result))
    if args.out:
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    # The engine's own allocator settings, as its entry point sets them (before torch).
    from dpo_megatron.parallel.host_malloc import restart_with_malloc_tunables

    restart_with_malloc_tunables()
    sys.exit(main())
