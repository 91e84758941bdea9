#!/usr/bin/env python
"""Every objective beside its peer, in one command: DPO against TRL's DPOTrainer, KTO against
TRL's KTOTrainer, the Bradley-Terry reward model against TRL's RewardTrainer, and generation
against ``transformers``' ``generate``.

    .venv/bin/python scripts/bench_objectives.py                       # SmolLM2-135M + 4-layer cut
    .venv/bin/python scripts/bench_objectives.py --models smollm2 --objectives kto,reward
    .venv/bin/python scripts/bench_objectives.py --objectives generation --batches 8 --modes greedy
    .venv/bin/python scripts/bench_objectives.py --from-json runs/objectives.json   # ratios again

The machinery and the honesty rules are ``scripts/bench_dpo.py``'s: every (model, objective,
engine) is a fresh child process, one after the other (each peak RSS is that run's own), on the
same model (SmolLM2-135M-Instruct or its first 4 layers), fp32, one thread, dropout off.

* **Training** (``dpo``, ``kto``, ``reward``): the same first items of the objective's real data
  (``dpo_en_demo`` pairs; ``kto_en_demo``'s unpaired rows, each with the mismatched completion
  of KTO's KL estimate, ``data.unpaired``) tokenized once by the engine's pipeline and handed to
  TRL as token ids (its tokenization is skipped), in file order, the same batch, steps, constant
  lr, Adam, clip 1.0. The engine runs its defaults (what a user gets); TRL its own (a reference
  model every step, as a TRL user runs it). The reward model's head starts at zero on both sides
  (the engine's initialisation: step-0 loss ln 2). Reported: real (non-pad) tokens per second
  of CPU time and of wall clock over the steps after warm-up (a sequence's prompt counted each
  time it is run, as TRL counts it: KTO's example and its KL sequence, a pair's two sequences),
  peak RSS, step-0 values (they must be equal) and the loss at every step.
* **Generation** (``generation``): the first prompts of ``dpo_en_demo`` rendered with the chat
  template and encoded by the engine's data path (at most ``--max-prompt-tokens``, the longest
  cut from the left), in calls of ``batch`` prompts in file order on both sides (transformers
  left-pads its batch), ``--max-new-tokens`` per completion with no stop at EOS (equal work),
  greedy (completions must be identical) or sampled (temperature, top-p; top-k off). Sampled,
  ``--samples`` completions per prompt (as the online loop's ``samples_per_prompt``): a call's
  ``batch x samples`` rows are one micro-batch of the engine's and transformers'
  ``num_return_sequences``. Each side runs once untimed on one prompt first. Reported:
  generated tokens per CPU-second and per second, peak RSS, identical completions.

The JSON is keyed ``results[model][objective][engine]`` (generation: one objective per mode and
batch, ``generation/greedy/batch8``), and the command prints every ratio against the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_dpo  # noqa: E402  (the sibling script: one measurement harness)

from dpo_megatron.utils.files import write_json_atomic  # noqa: E402

TRAINING = ("dpo", "kto", "reward")
OBJECTIVES = (*TRAINING, "generation")
PEERS = {"dpo": "trl", "kto": "trl", "reward": "trl", "generation": "transformers"}
"""Objective -> the peer the engine is measured against (the run named so in the results)."""
PEER_NAMES = {
    "dpo": "TRL's DPOTrainer",
    "kto": "TRL's KTOTrainer",
    "reward": "TRL's RewardTrainer",
    "generation": "transformers' generate",
}
MODES = ("greedy", "sampled")


def objective_of(key: str) -> str:
    """``generation/greedy/batch8`` -> ``generation``; a training objective is its own key."""
    return key.split("/")[0]


def generation_key(mode: str, batch: int, samples: int = 1) -> str:
    """``generation/sampled/batch2`` (one completion per prompt) or ``.../batch2x4``."""
    return f"generation/{mode}/batch{batch}" + (f"x{samples}" if samples > 1 else "")


# ----------------------------------------------------------------------------------------------
# TRL's trainers of the other objectives (DPO: bench_dpo.run_trl)


def run_trl_kto(spec: dict) -> dict:
    """TRL's KTOTrainer on the engine's unpaired examples and their KL completions (given as
    ``KL_completion_ids``, so both sides measure KL with the same sequences), same batch, order
    and hyper-parameters; TRL's default reference (a model, run every step)."""
    import torch

    torch.set_num_threads(spec["threads"])
    meter = bench_dpo.PeakRSS()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    items, _ = bench_dpo.bench_items(
        spec["pairs"], spec["max_length"], spec["max_prompt_length"], "kto"
    )
    rows = [
        {
            "prompt_ids": list(x.prompt_ids),
            "completion_ids": list(x.chosen_ids),
            "KL_completion_ids": list(x.rejected_ids),
            "label": bool(x.desirable),
        }
        for x in items
    ]

    def count(inputs):  # the examples and their KL sequences: both are run
        real = inputs["attention_mask"].sum() + inputs["KL_attention_mask"].sum()
        return real, inputs["input_ids"].numel() + inputs["KL_input_ids"].numel()

    args = bench_dpo.trl_args(
        spec,
        KTOConfig,
        beta=spec["beta"],
        loss_type="kto",
        desirable_weight=1.0,
        undesirable_weight=1.0,
        train_sampling_strategy="sequential",
    )
    return bench_dpo.train_trl(
        spec,
        meter,
        KTOTrainer,
        rows,
        count,
        model=AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32),
        args=args,
        processing_class=AutoTokenizer.from_pretrained(spec["model_path"]),
    )


def run_trl_reward(spec: dict) -> dict:
    """TRL's RewardTrainer on the engine's pairs (prompt + chosen, prompt + rejected), its model
    the folder as ``AutoModelForSequenceClassification`` (one label) with the score head zeroed
    (the engine's initialisation), same batch, order and hyper-parameters."""
    import torch

    torch.set_num_threads(spec["threads"])
    meter = bench_dpo.PeakRSS()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    pairs, pad = bench_dpo.bench_items(
        spec["pairs"], spec["max_length"], spec["max_prompt_length"], "reward"
    )
    rows = [
        {
            "chosen_ids": list(p.prompt_ids) + list(p.chosen_ids),
            "rejected_ids": list(p.prompt_ids) + list(p.rejected_ids),
        }
        for p in pairs
    ]
    model = AutoModelForSequenceClassification.from_pretrained(
        spec["model_path"], num_labels=1, dtype=torch.float32
    )
    with torch.no_grad():
        model.score.weight.zero_()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    if tokenizer.pad_token_id != pad:
        raise ValueError(f"the tokenizer's pad {tokenizer.pad_token_id} is not the engine's {pad}")
    return bench_dpo.train_trl(
        spec,
        meter,
        RewardTrainer,
        rows,
        lambda inputs: (inputs["attention_mask"].sum(), inputs["input_ids"].numel()),
        model=model,
        args=bench_dpo.trl_args(spec, RewardConfig, center_rewards_coefficient=None),
        processing_class=tokenizer,
    )


# ----------------------------------------------------------------------------------------------
# generation


def generation_prompts(count: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the first ``count`` dpo_en_demo prompts, as the data path encodes them (the
    chat template's generation prompt included), each cut to its last ``max_tokens``."""
    from dpo_megatron.data.encode import encode_prompt, encode_settings
    from dpo_megatron.data.tokenizer import load_tokenizer
    from dpo_megatron.utils.cache import asset_path

    tokenizer = load_tokenizer(str(asset_path("smollm2")))
    rows = json.loads(Path(asset_path("dpo_en_demo")).read_text())
    settings = encode_settings(tokenizer, None)
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    prompts = []
    for row in rows[:count]:
        messages = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
        prompts.append(list(encode_prompt(messages, tokenizer, settings)[-max_tokens:]))
    if len(prompts) < count:
        raise ValueError(f"dpo_en_demo has {len(prompts)} prompts, {count} asked")
    return prompts


def _engine_generator(spec: dict):
    """The engine's ``generate`` on one rank (KV cache), as ``call(prompts, new_tokens)``, and
    the block its calls run in: the weights packed for oneDNN once for all of them on the CPU
    (``compat.onednn_inference_linear``), as one call over every prompt would."""
    from dpo_megatron.compat import before_megatron_import

    before_megatron_import()
    from dpo_megatron.generation import SamplingParams, generate
    from dpo_megatron.models import ModelConfig, build_model_chunks, load_hf_weights
    from dpo_megatron.models.conversion import model_config_from_hf
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    cfg = model_config_from_hf(
        spec["model_path"], ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, spec["model_path"])
    greedy = spec["mode"] == "greedy"

    def call(prompts, new_tokens):
        params = SamplingParams(
            temperature=0.0 if greedy else spec["temperature"],
            top_p=1.0 if greedy else spec["top_p"],
            max_new_tokens=new_tokens,
            seed=spec["seed"],
        )
        samples = spec.get("samples", 1)
        out = generate(
            chunks,
            prompts,
            params,
            num_samples=samples,
            micro_batch_size=spec["batch"] * samples,  # one call's rows, as transformers' batch
            pad_id=0,
            vocab_size=cfg.vocab_size,
        )
        return [completion for per_prompt in out for completion in per_prompt]

    from dpo_megatron.compat.onednn_inference_linear import packed_linears

    return call, lambda: packed_linears(chunks)


def _transformers_generator(spec: dict):
    """``transformers``' ``generate`` on left-padded rows, as ``call(prompts, new_tokens)``:
    exactly ``new_tokens`` per row (no stop), greedy or sampled with top-k off; no block
    around its calls."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).eval()
    torch.manual_seed(spec["seed"])
    sampling = (
        {"do_sample": False}
        if spec["mode"] == "greedy"
        else {
            "do_sample": True,
            "temperature": spec["temperature"],
            "top_p": spec["top_p"],
            "top_k": 0,
        }
    )

    def call(prompts, new_tokens):
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding, as the engine lays out its rows
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.no_grad():
            full = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                eos_token_id=None,  # no stop, and no EOS suppressed (as the engine's rows)
                pad_token_id=0,
                num_return_sequences=spec.get("samples", 1),  # each prompt's samples adjacent
                **sampling,
            )
        return full[:, width:].tolist()

    return call, contextlib.nullcontext


def run_generation(spec: dict) -> dict:
    """One side of one generation case (``spec["run"]``: engine or transformers): the prompts
    in calls of ``spec["batch"]``, timed after one untimed call on the first prompt."""
    import torch

    torch.set_num_threads(spec["threads"])
    meter = bench_dpo.PeakRSS()
    prompts = generation_prompts(spec["prompts"], spec["max_prompt_tokens"])
    side = _engine_generator if spec["run"] == "engine" else _transformers_generator
    call, block = side(spec)
    call(prompts[:1], 2)  # first-call overheads
    completions: list[list[int]] = []
    w0, c0 = time.perf_counter(), time.process_time()
    with block():  # timed: the engine packs its weights in it
        for i in range(0, len(prompts), spec["batch"]):
            completions += call(prompts[i : i + spec["batch"]], spec["max_new_tokens"])
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    tokens = sum(len(c) for c in completions)
    return {
        "tokens": tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "wall_s": wall,
        "cpu_s": cpu,
        "real_tokens_per_s": tokens / wall,
        "real_tokens_per_cpu_s": tokens / cpu,
        "peak_rss_bytes": meter.stop(),
        "completions": completions,
    }


# ----------------------------------------------------------------------------------------------
# driver


def worker(spec: dict) -> dict:
    """The measurement of one child process (``--worker``)."""
    objective = objective_of(spec["objective"])
    if objective == "generation":
        return run_generation(spec)
    if spec["run"] != "trl":
        return bench_dpo.run_engine(spec)
    return {"dpo": bench_dpo.run_trl, "kto": run_trl_kto, "reward": run_trl_reward}[objective](spec)


def compare(result: dict, peer: dict, objective: str) -> dict:
    """Engine / peer ratios (throughput: > 1 is faster; peak RSS: < 1 is smaller) and what must
    be equal: the step-0 loss (training) or the completions (greedy generation)."""
    out = {
        "tokens_per_cpu_s": result["real_tokens_per_cpu_s"] / peer["real_tokens_per_cpu_s"],
        "tokens_per_s": result["real_tokens_per_s"] / peer["real_tokens_per_s"],
        "peak_rss": result["peak_rss_bytes"] / peer["peak_rss_bytes"],
    }
    if objective_of(objective) != "generation":
        out["step0_loss_abs_diff"] = abs(result["step0"]["loss"] - peer["step0"]["loss"])
    elif objective.split("/")[1] == "greedy":
        pairs = list(zip(result["completions"], peer["completions"], strict=True))
        out["identical_completions"] = sum(a == b for a, b in pairs)
        out["completions"] = len(pairs)
    return out


def ratio_lines(report: dict) -> list[str]:
    """One line per (model, objective) that ran on both sides: every ratio against the peer."""
    lines = []
    for model, objectives in report["results"].items():
        for key, runs in objectives.items():
            peer = PEERS[objective_of(key)]
            if "engine" not in runs or peer not in runs:
                continue
            q = compare(runs["engine"], runs[peer], key)
            line = (
                f"{model:11s} {key:27s} engine / {peer}: {q['tokens_per_cpu_s']:.2f}x tokens "
                f"per CPU-s, {q['tokens_per_s']:.2f}x per s, peak RSS {q['peak_rss']:.2f}x"
            )
            if "step0_loss_abs_diff" in q:
                line += (
                    f", step-0 loss {runs['engine']['step0']['loss']:.6f} vs "
                    f"{runs[peer]['step0']['loss']:.6f}"
                )
            if "identical_completions" in q:
                line += f", identical completions {q['identical_completions']}/{q['completions']}"
            lines.append(line)
    return lines


def markdown(report: dict) -> str:
    """The results as Markdown: one table per model (a row per objective and engine), then the
    ratios."""
    lines = []
    for model, objectives in report["results"].items():
        lines += [
            f"#### {model}",
            "",
            "| objective | engine | tokens / CPU-s | tokens / s | peak RSS (GiB) | step-0 loss | "
            "losses (every step) |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, runs in objectives.items():
            for name, r in runs.items():
                loss0 = f"{r['step0']['loss']:.6f}" if "step0" in r else ""
                losses = ", ".join(f"{x:.6f}" for x in r.get("losses", []))
                lines.append(
                    f"| {key} | {name} | {r['real_tokens_per_cpu_s']:.1f} | "
                    f"{r['real_tokens_per_s']:.1f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
                    f"{loss0} | {losses} |"
                )
        lines.append("")
    lines += ["Ratios (engine / peer):", "", *(f"- {x}" for x in ratio_lines(report)), ""]
    return "\n".join(lines)


def cases(args) -> list[tuple[str, str, dict]]:
    """(objective key, run, spec part) of every child, in order: each objective's peer first."""
    out = []
    for objective in args.objectives.split(","):
        if objective not in OBJECTIVES:
            raise SystemExit(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
        if objective != "generation":
            for run in ("trl", "engine"):
                out.append((objective, run, {}))
            continue
        if args.samples < 1:
            raise SystemExit(f"--samples must be at least 1, got {args.samples}")
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
            if mode == "greedy" and args.samples > 1:
                raise SystemExit(
                    "--samples above 1 needs --modes sampled (greedy samples of a prompt are "
                    "one completion)"
                )
            for batch in (int(b) for b in args.batches.split(",")):
                key = generation_key(mode, batch, args.samples)
                part = {
                    "mode": mode,
                    "batch": batch,
                    "prompts": max(args.prompts, batch),
                    "samples": args.samples,
                }
                for run in ("transformers", "engine"):
                    out.append((key, run, part))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    # The docstring's first paragraph: its first sentence runs over four lines.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,smollm2-4l", help="smollm2, smollm2-4l")
    parser.add_argument(
        "--objectives", default=",".join(OBJECTIVES), help=f"comma list of {', '.join(OBJECTIVES)}"
    )
    parser.add_argument("--steps", type=int, default=3, help="training: optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="training: steps left out")
    parser.add_argument("--pairs-per-step", type=int, default=4, help="training: items per step")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--beta", type=float, default=0.1, help="DPO and KTO")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batches", default="1,8,32", help="generation: prompts per call")
    parser.add_argument("--modes", default="greedy,sampled", help="generation: greedy, sampled")
    parser.add_argument(
        "--prompts", type=int, default=16, help="generation: prompts (at least one batch)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=1,
        help="generation: completions per prompt (sampled; a call's rows: batch x samples)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="sampled generation")
    parser.add_argument("--top-p", type=float, default=0.95, help="sampled generation")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", default="bench_objectives.json")
    parser.add_argument("--markdown", default="", help="also write the tables to this file")
    parser.add_argument("--from-json", default="", help="print the ratios of an earlier run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = bench_dpo.in_scratch(worker, json.loads(args.worker))
        Path(args.worker_out).write_text(json.dumps(result))
        return 0
    if args.from_json:
        print(markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    base = {
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs_per_step": args.pairs_per_step,
        "micro_batch_size": args.pairs_per_step,
        "pairs": args.pairs_per_step * args.steps,
        "max_length": args.max_length,
        "max_prompt_length": args.max_prompt_length,
        "beta": args.beta,
        "lr": args.lr,
        "recompute": "",
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "threads": args.threads,
    }
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": base,
        "machine": bench_dpo.machine(),
        "results": {},
    }
    started = time.time()
    todo = cases(args)
    for model in args.models.split(","):
        path = bench_dpo.model_folder(model)
        results = report["results"].setdefault(model, {})
        for key, run, part in todo:
            objective = objective_of(key)
            who = PEER_NAMES[objective] if run == PEERS[objective] else "the engine"
            spec = {
                **base,
                **part,
                "objective": key,
                "run": run,
                "model": model,
                "model_path": path,
                "doing": f"{key} on {model}: {who}",
            }
            t0 = time.time()
            # A run is silent for minutes (its output is kept for a failure): say what runs.
            print(f"running {spec['doing']} ...", flush=True)
            result = bench_dpo._child(spec, script=__file__)
            results.setdefault(key, {})[run] = result
            print(
                f"{model:11s} {key:27s} {run:12s} {result['real_tokens_per_cpu_s']:8.1f} "
                f"tokens/CPU-s {result['real_tokens_per_s']:8.1f} tokens/s  rss "
                f"{result['peak_rss_bytes'] / 2**30:.2f} GiB"
                + (f"  loss0 {result['step0']['loss']:.6f}" if "step0" in result else "")
                + f"  ({time.time() - t0:.0f} s)",
                flush=True,
            )
            write_json_atomic(args.out, report)
    bench_dpo.finish(report, started, args.out, args.markdown, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
