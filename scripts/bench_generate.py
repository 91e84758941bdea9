#!/usr/bin/env python
"""Greedy generation speed, side by side in one process: this engine
(``dpo_megatron.generation.generate``, KV cache, one rank) and ``transformers``' ``generate``.

    .venv/bin/python scripts/bench_generate.py                              # SmolLM2-135M-Instruct
    .venv/bin/python scripts/bench_generate.py --prompts 2 --max-new-tokens 8   # smoke run

Both get the same model folder (default: the cached SmolLM2-135M-Instruct asset), the same
prompts (the first N prompts of LLaMA-Factory's dpo_en_demo rendered with the chat template and
encoded by the engine's data path, at most ``--max-prompt-tokens`` tokens, the longest cut from
the left), the same batch size (``--batch-size`` rows per call; transformers left-pads its batch
as the engine does), fp32, greedy, the same ``--max-new-tokens``. By default neither stops at EOS
(every row generates exactly ``--max-new-tokens`` tokens, so the work is equal); ``--stop-at-eos``
lets both stop. Each side runs once untimed on one prompt first (first-call overheads), then
timed. Printed: generated tokens, seconds, tokens/s of each, their ratio, and how many
completions are identical (greedy: all of them, up to fp32 ties).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dpo_megatron.compat import before_megatron_import  # noqa: E402

before_megatron_import()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="HF folder (default: the SmolLM2 asset)")
    parser.add_argument("--prompts", type=int, default=16, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per call (both sides)")
    parser.add_argument("--stop-at-eos", action="store_true")
    parser.add_argument("--json", default="", help="also write the results to this file")
    return parser.parse_args(argv)


def load_prompts(tokenizer, count: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the first ``count`` dpo_en_demo prompts, as the data path encodes them."""
    from dpo_megatron.data.encode import encode_prompt, encode_settings
    from dpo_megatron.utils.cache import asset_path

    rows = json.loads(Path(asset_path("dpo_en_demo")).read_text())
    settings = encode_settings(tokenizer, None)
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    prompts = []
    for row in rows[:count]:
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
        prompts.append(encode_prompt(messages, tokenizer, settings)[-max_tokens:])
    return prompts


def run_engine(model_dir: str, prompts, args, stop_ids) -> tuple[list[list[int]], float]:
    from dpo_megatron.generation import SamplingParams, generate
    from dpo_megatron.models import ModelConfig, build_model_chunks, load_hf_weights
    from dpo_megatron.models.conversion import model_config_from_hf
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    cfg = model_config_from_hf(
        model_dir, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, model_dir)

    def call(batch, new_tokens):
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, stop_ids=stop_ids)
        out = generate(
            chunks,
            batch,
            params,
            micro_batch_size=args.batch_size,
            pad_id=0,
            vocab_size=cfg.vocab_size,
        )
        return [samples[0] for samples in out]

    call(prompts[:1], 2)  # warm-up
    started = time.perf_counter()
    out = []
    for i in range(0, len(prompts), args.batch_size):  # one call per batch, as transformers
        out += call(prompts[i : i + args.batch_size], args.max_new_tokens)
    return out, time.perf_counter() - started


def run_transformers(model_dir: str, prompts, args, stop_ids) -> tuple[list[list[int]], float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = list(stop_ids) if stop_ids else None

    def call(batch, new_tokens):
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch):  # left padding, as the engine lays out its rows
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.no_grad():
            full = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=None if eos else new_tokens,
                eos_token_id=eos,
                pad_token_id=0,
            )
        out = []
        for row in full[:, width:].tolist():
            if eos:  # up to and including the first stop token
                ends = [i for i, t in enumerate(row) if t in stop_ids]
                row = row[: ends[0] + 1] if ends else row
            out.append(row)
        return out

    call(prompts[:1], 2)  # warm-up
    started = time.perf_counter()
    out = []
    for i in range(0, len(prompts), args.batch_size):
        out += call(prompts[i : i + args.batch_size], args.max_new_tokens)
    return out, time.perf_counter() - started


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from dpo_megatron.data.tokenizer import load_tokenizer
    from dpo_megatron.utils.cache import asset_path

    model_dir = args.model or str(asset_path("smollm2"))
    tokenizer = load_tokenizer(model_dir)
    prompts = load_prompts(tokenizer, args.prompts, args.max_prompt_tokens)
    stop_ids = (tokenizer.eos_token_id,) if args.stop_at_eos else ()
    engine, engine_s = run_engine(model_dir, prompts, args, stop_ids)
    hf, hf_s = run_transformers(model_dir, prompts, args, stop_ids)
    engine_tokens = sum(len(c) for c in engine)
    hf_tokens = sum(len(c) for c in hf)
    result = {
        "model": model_dir,
        "prompts": len(prompts),
        "prompt_tokens_mean": sum(len(p) for p in prompts) / len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "threads": __import__("torch").get_num_threads(),
        "engine": {
            "tokens": engine_tokens,
            "seconds": engine_s,
            "tokens_per_s": engine_tokens / engine_s,
        },
        "transformers": {"tokens": hf_tokens, "seconds": hf_s, "tokens_per_s": hf_tokens / hf_s},
        "identical_completions": sum(a == b for a, b in zip(engine, hf)),
    }
    lines = [
        f"{len(prompts)} prompts (mean {result['prompt_tokens_mean']:.0f} tokens), "
        f"{args.max_new_tokens} new tokens, batch {args.batch_size}, greedy, fp32, "
        f"{result['threads']} threads"
    ]
    for name in ("engine", "transformers"):
        r = result[name]
        lines.append(
            f"{name:12s} {r['tokens']:6d} tokens {r['seconds']:8.2f} s "
            f"{r['tokens_per_s']:8.1f} tokens/s"
        )
    ratio = result["engine"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    lines.append(
        f"engine / transformers: {ratio:.2f}x; identical completions: "
        f"{result['identical_completions']} of {len(prompts)}"
    )
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
