#!/usr/bin/env python
"""DPO throughput, side by side: this engine (several settings) and TRL's DPOTrainer.

    .venv/bin/python scripts/bench_dpo.py                      # SmolLM2-135M + its 4-layer cut
    .venv/bin/python scripts/bench_dpo.py --models smollm2-4l --steps 4 --engines trl,engine
    .venv/bin/python scripts/bench_dpo.py --models qwen3moe-e4,qwen3moe-e8 --engines engine

Both engines get the same model (SmolLM2-135M-Instruct, or its first 4 layers), the same first N
pairs of LLaMA-Factory's dpo_en_demo tokenized once by this engine's data pipeline (TRL receives
the token ids, so tokenization cannot differ), in the same order, the same max_length, pairs per
step, beta, learning rate (constant, Adam, clip 1.0), fp32, dropout off. Each (model, engine) run
is a fresh child process, one after the other, so peak resident memory is that run's own.

Reported per run: real (non-pad) tokens per second (wall clock and process CPU time), padded
fraction (pad positions / positions computed), step time (median over steps after warm-up),
peak RSS, step-0 loss and logps; then ratios against TRL. On a machine shared with other jobs the
CPU-time figures are the fairer comparison: they do not count time the process spent waiting for
a core. Results go to a JSON file and a Markdown table (``--markdown``).

Every run uses glibc's malloc, TRL's as it comes, the engine's runs with their default
``DPO_MEGATRON_HOST_MALLOC=trim`` (every block from the heap, free heap pages returned between
layers' forwards: ``dpo_megatron.parallel.host_malloc``); a run name ending in ``+malloc``
(``trl+malloc``, ``engine+malloc``, ...) runs that setting with the engine's opt-in tunables
(``DPO_MEGATRON_HOST_MALLOC=release``), which hand large freed tensors back to the OS, and
``engine+system-malloc`` the engine with glibc as it comes (``DPO_MEGATRON_HOST_MALLOC=system``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# standard library only: safe before the worker imports torch
from dpo_megatron.parallel.host_malloc import SWITCH, describe, malloc_env, malloc_in_use  # noqa: E402
from dpo_megatron.utils.files import (  # noqa: E402
    atomic_file,
    write_json_atomic,
    write_text_atomic,
)

# The defaults before the speed settings went to auto (padded rows, the reference model every
# step, the fused LM head): every named setting below starts from them, so each name keeps its
# meaning; "engine" alone is today's default (the speed settings left to auto:
# ``training.auto_settings``).
OLD_DEFAULT = (
    "packing.enabled=false",
    "packing.share_prompt=false",
    "reference.mode=model",
    "model.fused_lm_head=true",
)
PACKED = ("packing.enabled=true",)
SHARED = ("packing.enabled=true", "packing.share_prompt=true")
PRECOMPUTED = ("reference.mode=precomputed",)
BF16 = ("model.params_dtype=bfloat16",)
RECOMPUTE = (
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",  # a layer each
    "model.recompute_num_layers=1",
)
LORA = ("lora.enabled=true", "lora.rank=16", "lora.alpha=32")
ENGINES = {
    # name: the engine's config overrides on top of engine_config()'s
    "engine": (),  # the default: what a user gets without setting anything
    "engine+bf16": BF16,  # the default in bf16 (mixed precision: fp32 main weights in Adam)
    "engine+old-default": (),  # the default before auto (OLD_DEFAULT)
    "engine+packing": PACKED,
    "engine+shared": SHARED,
    "engine+precomputed": PRECOMPUTED,
    "engine+packing+precomputed": PACKED + PRECOMPUTED,
    "engine+shared+precomputed": SHARED + PRECOMPUTED,
    "engine+shared+precomputed+recompute": SHARED + PRECOMPUTED + RECOMPUTE,
    # full recompute of the first 8 of the 30 layers only: between the two settings above
    "engine+shared+precomputed+recompute8": SHARED
    + PRECOMPUTED
    + (
        "model.recompute_granularity=full",
        "model.recompute_method=block",
        "model.recompute_num_layers=8",
    ),
    # the output layer's logits kept for backward (no second LM-head matmul)
    "engine+shared+precomputed+unfused": SHARED + PRECOMPUTED + ("model.fused_lm_head=false",),
    "engine+shared+precomputed+recompute8+unfused": SHARED
    + PRECOMPUTED
    + (
        "model.recompute_granularity=full",
        "model.recompute_method=block",
        "model.recompute_num_layers=8",
        "model.fused_lm_head=false",
    ),
    # LoRA DPO: rank 16 on all four linear layers; the frozen base is the reference.
    "lora": LORA,
    "lora+recompute": LORA + RECOMPUTE,
}
AUTO = ("engine", "engine+bf16")
"""Settings that run the engine's defaults; every other one starts from :data:`OLD_DEFAULT`."""
MALLOC = "+malloc"  # suffix: the same run with the engine's opt-in glibc malloc tunables
SYSTEM_MALLOC = "+system-malloc"  # suffix: the engine without its default heap trimming
HOST_MALLOC_SUFFIXES = {MALLOC: "release", SYSTEM_MALLOC: "system"}
"""Run-name suffix -> the ``DPO_MEGATRON_HOST_MALLOC`` value the run is started with."""
TRL_RUNS = ("trl", "trl" + MALLOC, "trl+bf16")
"""``trl+bf16``: TRL's ``bf16=True`` (autocast to bf16 around fp32 weights, as a user runs it)."""
ALL_RUNS = [*TRL_RUNS, *ENGINES, "engine" + MALLOC, "engine" + SYSTEM_MALLOC]


def _suffix(run: str) -> str:
    return next((s for s in HOST_MALLOC_SUFFIXES if run.endswith(s)), "")


def setting(run: str) -> str:
    """The TRL / ENGINES name of a run (without a :data:`HOST_MALLOC_SUFFIXES` suffix)."""
    return run[: len(run) - len(_suffix(run))]


# Default runs per model: on the full model TRL, the plain default, packing alone, shared prompts
# alone (the prefix-sharing gain over packing), and the best settings; on the 4-layer cut, the
# plain and the best ones.
DEFAULT_RUNS = {
    "smollm2": ["trl", "engine", "engine+old-default", "trl+bf16", "engine+bf16"],
    "smollm2-4l": ["trl", "engine", "engine+packing", "engine+shared", "engine+shared+precomputed"],
}


# ----------------------------------------------------------------------------------------------
# shared set-up: model folders and data


MOE_PREFIX = "qwen3moe-e"
"""``qwen3moe-e<E>``: a random Qwen3-MoE of SmolLM2's vocabulary with E experts (same layers,
widths and top-2 routing for every E), to see how a step's cost grows with the experts."""


def moe_folder(num_experts: int) -> str:
    """A random tiny Qwen3-MoE with ``num_experts`` experts (4 layers, hidden 256, experts 256
    wide, top-2, SmolLM2's tokenizer), written once to the cache."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from dpo_megatron.utils import cache as assets  # the cache; scripts/assets.py builds it

    out = assets.cache_root() / "bench" / f"qwen3moe-e{num_experts}"
    if (out / "model.safetensors").is_file():
        return str(out)
    config = Qwen3MoeConfig(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=num_experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in assets.asset_path("smollm2").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


def model_folder(name: str) -> str:
    """HF folder of the benchmarked model: 'smollm2' (30 layers), 'smollm2-4l' (its first 4
    layers, written once to the cache) or ``qwen3moe-e<E>`` (:data:`MOE_PREFIX`)."""
    from dpo_megatron.utils import cache as assets  # the cache; scripts/assets.py builds it

    if name.startswith(MOE_PREFIX) and name[len(MOE_PREFIX) :].isdigit():
        return moe_folder(int(name[len(MOE_PREFIX) :]))
    full = assets.asset_path("smollm2")
    if name == "smollm2":
        return str(full)
    if name != "smollm2-4l":
        raise ValueError(
            f"unknown model {name!r}; known: smollm2, smollm2-4l, {MOE_PREFIX}<experts>"
        )
    out = assets.cache_root() / "bench" / "smollm2-135m-4layers"
    if (out / "model.safetensors").is_file():
        return str(out)
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = 4
    tensors = load_file(str(full / "model.safetensors"))
    keep = {
        k: v
        for k, v in tensors.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4
    }
    for f in full.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in (
            "config.json",
            "dpo_megatron_asset.json",
        ):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    with atomic_file(out / "model.safetensors") as tmp:
        save_file(keep, tmp, metadata={"format": "pt"})
    return str(out)


OBJECTIVE_DATA = {
    # objective: (asset, the engine's data.format, the item kind the loss trains on)
    "dpo": ("dpo_en_demo", "sharegpt", "pairs"),
    "reward": ("dpo_en_demo", "sharegpt", "pairs"),
    "kto": ("kto_en_demo", "kto_messages", "unpaired"),
}
"""The data of each training objective: LLaMA-Factory's real pairs for DPO and the reward model,
its real unpaired rows for KTO (each with its mismatched completion: ``data.unpaired``)."""


def bench_items(
    num_items: int, max_length: int, max_prompt_length: int, objective: str = "dpo"
) -> tuple[list, int]:
    """The first ``num_items`` kept items of the objective's data (:data:`OBJECTIVE_DATA`, file
    order), tokenized with SmolLM2's chat template by this engine's pipeline, and the pad id.

    Raises:
        ValueError: fewer than ``num_items`` items fit ``max_length``.
    """
    from dpo_megatron.data import DataConfig, load_items, load_tokenizer
    from dpo_megatron.utils import cache as assets  # the cache; scripts/assets.py builds it

    asset, fmt, kind = OBJECTIVE_DATA[objective]
    tokenizer = load_tokenizer(str(assets.asset_path("smollm2")))
    cfg = DataConfig(
        path=str(assets.asset_path(asset)),
        format=fmt,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        eval_fraction=0.0,
        verbose=False,
    )
    items = load_items(cfg, tokenizer, kind).train
    if len(items) < num_items:
        raise ValueError(f"only {len(items)} items of {asset} fit max_length={max_length}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return items[:num_items], pad


def bench_pairs(num_pairs: int, max_length: int, max_prompt_length: int):
    """The first ``num_pairs`` kept pairs of dpo_en_demo (file order), tokenized with SmolLM2's
    chat template by this engine's pipeline, and the pad id."""
    return bench_items(num_pairs, max_length, max_prompt_length, "dpo")


# ----------------------------------------------------------------------------------------------
# measurement


class PeakRSS:
    """Samples the process's resident set size (and the allocator's bytes in use) every
    ``interval`` s in a thread (bytes)."""

    def __init__(self, interval: float = 0.02):
        import psutil

        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self.peak_in_use = malloc_in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self.peak_in_use = max(self.peak_in_use, malloc_in_use())

    def stop_sampling(self) -> int:
        """Stop; the highest sampled RSS since the start (bytes)."""
        self._stop.set()
        self._thread.join()
        return self.peak

    def stop(self) -> int:
        """Stop; the process's peak RSS (sampled, or ``ru_maxrss`` if higher; bytes)."""
        self.stop_sampling()
        import resource

        # ru_maxrss (KiB on Linux) also catches a peak between two samples.
        return max(self.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def summarize(steps: list[dict], warmup: int) -> dict:
    """Per-step records -> the reported numbers (medians and sums over the timed steps).

    Each record: wall_s, cpu_s, real_tokens, computed_tokens (positions run, padding included),
    optional model_tokens (positions holding a token; default real_tokens), loss. Tokens per
    second are total real tokens over total time of the timed steps (steps >= ``warmup``); the
    padded fraction is 1 - model_tokens / computed_tokens.
    """
    timed = steps[warmup:] or steps
    wall = sum(s["wall_s"] for s in timed)
    cpu = sum(s["cpu_s"] for s in timed)
    real = sum(s["real_tokens"] for s in timed)
    computed = sum(s["computed_tokens"] for s in timed)
    # positions holding a token (a shared prompt once: fewer than the real tokens TRL counts)
    model = sum(s.get("model_tokens", s["real_tokens"]) for s in timed)
    return {
        "timed_steps": len(timed),
        "step_time_median_s": statistics.median(s["wall_s"] for s in timed),
        "step_cpu_median_s": statistics.median(s["cpu_s"] for s in timed),
        "real_tokens_per_s": real / wall,
        "real_tokens_per_cpu_s": real / cpu,
        "padded_fraction": 1.0 - model / computed,
        "real_tokens_per_step": real / len(timed),
        "model_tokens_per_real_token": model / real,
        "losses": [s["loss"] for s in steps],
    }


# ----------------------------------------------------------------------------------------------
# this engine


LOSS_OVERRIDES = {
    # objective: its loss section (TRL's defaults: DPOConfig / KTOConfig beta 0.1, KTO's weights
    # 1.0, RewardConfig's center_rewards_coefficient None = 0)
    "dpo": lambda spec: ("loss.name=sigmoid", f"loss.beta={spec['beta']}"),
    "kto": lambda spec: ("loss.name=kto", f"loss.beta={spec['beta']}"),
    "reward": lambda spec: ("loss.name=bradley_terry",),
}


STEP0_METRICS = ("loss", "logps/chosen", "logps/rejected", "kl", "rewards/chosen")
"""Step-0 values compared side by side (those the objective reports)."""


def engine_config(spec: dict, run_dir: str):
    """The engine's config for one benchmark run in ``run_dir``: world size 1, fp32, local spec,
    the objective's loss (``spec["objective"]``: sigmoid DPO by default, :data:`LOSS_OVERRIDES`),
    constant LR, no checkpoints, the data in file order (as TRL's sequential sampler)."""
    from dpo_megatron.config import load_config
    from dpo_megatron.utils import cache as assets  # the cache; scripts/assets.py builds it

    objective = spec.get("objective", "dpo")
    return load_config(
        None,
        [  # data.path names the pairs' source; they come in as token ids
            f"run_dir={run_dir}",
            f"data.path={assets.asset_path(OBJECTIVE_DATA[objective][0])}",
            f"data.format={OBJECTIVE_DATA[objective][1]}",
            f"model.hf_path={spec['model_path']}",
            # the default runs keep the engine's own choice (fp32 on the CPU) and say so
            f"model.params_dtype={'auto' if setting(spec['run']) in AUTO else 'float32'}",
            "model.transformer_impl=local",
            f"model.recompute_granularity={spec['recompute'] or 'null'}",
            *LOSS_OVERRIDES[objective](spec),
            f"train.lr={spec['lr']}",
            "train.lr_decay_style=constant",
            "train.clip_grad=1.0",
            "train.weight_decay=0.0",
            f"train.train_iters={spec['steps']}",
            f"train.global_batch_size={spec['pairs_per_step']}",
            f"train.micro_batch_size={spec['micro_batch_size']}",
            f"train.seed={spec['seed']}",
            "train.use_distributed_optimizer=false",
            "data.shuffle=false",
            # a fresh cache: the precompute pass is measured, never a cache hit
            f"reference.cache_dir={run_dir}/reference",
            f"reference.micro_batch_size={spec['pairs_per_step']}",
            "checkpoint.save_interval=0",
            "logging.tensorboard=false",
            f"model.local_attention={spec.get('local_attention') or 'sdpa'}",
            *(() if setting(spec["run"]) in AUTO else OLD_DEFAULT),
            *ENGINES[setting(spec["run"])],
        ],
    )


def in_scratch(measure, spec: dict) -> dict:
    """``measure(spec)`` with ``spec["scratch_dir"]`` a temporary folder for its run folders
    (the engine's ``run_dir``, TRL's ``output_dir``), removed when the measurement ends."""
    with tempfile.TemporaryDirectory(prefix="bench_") as scratch:
        return measure({**spec, "scratch_dir": scratch})


def run_engine(spec: dict) -> dict:
    """One engine run (world size 1, TP 1 x PP 1) in this process, through the engine's own
    ``Trainer``, its run folder under ``spec["scratch_dir"]``; returns the measurements."""
    import torch

    torch.set_num_threads(spec["threads"])
    meter = PeakRSS()
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    pairs, pad = bench_items(
        spec["pairs"], spec["max_length"], spec["max_prompt_length"], spec.get("objective", "dpo")
    )
    t0, c0 = time.perf_counter(), time.process_time()
    run_dir = os.path.join(spec["scratch_dir"], "engine")
    trainer = Trainer(engine_config(spec, run_dir), data=RunData(pairs, [], pad))
    setup_s, setup_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    precompute_s = trainer.timings["reference_setup_s"]
    # The precompute pass runs single-threaded inside set-up: its share of set-up CPU time.
    precompute_cpu_s = setup_cpu_s * precompute_s / setup_s if setup_s else 0.0
    steps, step0 = [], {}
    for step in range(spec["steps"]):
        w0, c0 = time.perf_counter(), time.process_time()
        out, batch = trainer.train_step()
        steps.append(
            {
                "wall_s": time.perf_counter() - w0,
                "cpu_s": time.process_time() - c0,
                "real_tokens": batch.real_tokens,
                "loss": out.metrics["loss"],
                "model_tokens": batch.computed_tokens,
                "computed_tokens": sum(mb.tokens.numel() for mb in batch.micro_batches),
            }
        )
        if step == 0:
            step0 = {k: out.metrics[k] for k in STEP0_METRICS if k in out.metrics}
    summary = summarize(steps, spec["warmup"])
    # One epoch over the benchmarked pairs, the precompute pass included: the reference forward
    # is moved before training, so its gain is per epoch after the first (or per cached rerun).
    epoch_tokens = sum(s["real_tokens"] for s in steps)
    summary["real_tokens_per_cpu_s_first_epoch"] = epoch_tokens / (
        epoch_tokens / summary["real_tokens_per_cpu_s"] + precompute_cpu_s
    )
    return {
        **summary,
        "step0": step0,
        "precompute_s": precompute_s,
        "precompute_cpu_s": precompute_cpu_s,
        "peak_rss_bytes": meter.stop(),
        "steps": steps,
        "reference_model_held": trainer.reference is not None,
        "heap_trims": trainer.heap_trimmer.trims if trainer.heap_trimmer else None,
        "speed_line": trainer.auto_settings.line,
    }


# ----------------------------------------------------------------------------------------------
# TRL


def trl_args(spec: dict, config_class, **objective_args):
    """TRL's config (``DPOConfig``, ``KTOConfig``, ``RewardConfig``) with the hyper-parameters
    every objective shares with the engine's run: batch, steps, constant lr, Adam, clip 1.0,
    fp32 (``trl+bf16``: TRL's ``bf16=True``), dropout off, one log line per step, no saving."""
    return config_class(
        output_dir=os.path.join(spec["scratch_dir"], "trl"),
        per_device_train_batch_size=spec["pairs_per_step"],
        gradient_accumulation_steps=1,
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_length=spec["max_length"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=spec["run"] == "trl+bf16",
        fp16=False,
        dataloader_num_workers=0,
        seed=spec["seed"],
        disable_dropout=True,
        gradient_checkpointing=False,
        **objective_args,
    )


def train_trl(spec: dict, meter: PeakRSS, trainer_class, rows: list[dict], count, **kwargs) -> dict:
    """Train TRL's ``trainer_class`` on ``rows`` (already token ids: its ``_prepare_dataset`` is
    skipped, so tokenization cannot differ from the engine's) in file order, timing each step;
    the measurements as :func:`run_engine` reports them.

    Args:
        count: a collated batch -> (real tokens, positions computed), the unit of tokens/s.
        kwargs: the trainer's other arguments (model, args, processing_class).
    """
    import datasets
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    steps: list[dict] = []

    class Trainer(trainer_class):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # already tokenized by the engine's pipeline: identical token ids

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # the engine's order (no shuffle)

        def training_step(self, model, inputs, *args, **kwargs):
            real, computed = count(inputs)
            steps.append({"real_tokens": int(real), "computed_tokens": int(computed)})
            return super().training_step(model, inputs, *args, **kwargs)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.w0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            steps[-1].update(
                wall_s=time.perf_counter() - self.w0, cpu_s=time.process_time() - self.c0
            )

    data = datasets.Dataset.from_list(rows)
    trainer = Trainer(train_dataset=data, callbacks=[Clock()], **kwargs)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    for s, h in zip(steps, logs):
        s["loss"] = float(h["loss"])
    step0 = {k: float(logs[0][k]) for k in STEP0_METRICS if k in logs[0]}
    summary = summarize(steps, spec["warmup"])
    summary["real_tokens_per_cpu_s_first_epoch"] = summary["real_tokens_per_cpu_s"]
    return {
        **summary,
        "step0": step0,
        "precompute_s": 0.0,
        "precompute_cpu_s": 0.0,
        "peak_rss_bytes": meter.stop(),
        "steps": steps,
    }


def run_trl(spec: dict) -> dict:
    """TRL DPOTrainer on the same token ids, batch, order and hyper-parameters."""
    import torch

    torch.set_num_threads(spec["threads"])
    meter = PeakRSS()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    pairs, pad = bench_pairs(spec["pairs"], spec["max_length"], spec["max_prompt_length"])
    rows = [
        {
            "prompt_ids": list(p.prompt_ids),
            "chosen_ids": list(p.chosen_ids),
            "rejected_ids": list(p.rejected_ids),
        }
        for p in pairs
    ]
    return train_trl(
        spec,
        meter,
        DPOTrainer,
        rows,
        lambda inputs: (inputs["attention_mask"].sum(), inputs["input_ids"].numel()),
        model=AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32),
        args=trl_args(spec, DPOConfig, beta=spec["beta"], loss_type=["sigmoid"]),
        processing_class=AutoTokenizer.from_pretrained(spec["model_path"]),
    )


# ----------------------------------------------------------------------------------------------
# driver


HEARTBEAT_S = 60.0
"""How often :func:`_child` says that a run is still going (seconds)."""


def _child(spec: dict, script: str = __file__, heartbeat_s: float = HEARTBEAT_S) -> dict:
    """Run one (model, engine) in a fresh interpreter (``script --worker``); returns its JSON
    result. Says every ``heartbeat_s`` while it runs that it is still running (``spec["doing"]``,
    else the run and model), so a long peer run (TRL's half takes minutes on the 30-layer
    model) is never a silent terminal; the drivers say what they start."""
    doing = (
        spec.get("doing") or f"{spec['run']} ({spec.get('objective', 'dpo')}) on {spec['model']}"
    )
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    # A fresh single-process world: no launcher variables inherited from the caller.
    launcher = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "ROLE_RANK",
        "TORCHELASTIC_RUN_ID",
    )
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(
        OMP_NUM_THREADS=str(spec["threads"]),
        MKL_NUM_THREADS=str(spec["threads"]),
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    env.pop(SWITCH, None)  # each run's own setting, not the caller's
    if _suffix(spec["run"]):
        env[SWITCH] = HOST_MALLOC_SUFFIXES[_suffix(spec["run"])]
        env = malloc_env(env) or env
    cmd = [sys.executable, script, "--worker", json.dumps(spec), "--worker-out", out]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        started = time.time()
        while True:
            try:
                proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                print(f"  ... {doing}: still running ({time.time() - started:.0f} s)", flush=True)
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        raise RuntimeError(
            f"{spec['run']} on {spec['model']} failed (exit status "
            f"{proc.returncode}):\n{output[-4000:]}"
        )
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def ratios(result: dict, baseline: dict) -> dict:
    """Engine / TRL ratios (>1 is better for throughput; <1 is better for time and memory)."""
    return {
        "real_tokens_per_s": result["real_tokens_per_s"] / baseline["real_tokens_per_s"],
        "real_tokens_per_cpu_s": result["real_tokens_per_cpu_s"]
        / baseline["real_tokens_per_cpu_s"],
        "step_time_median": result["step_time_median_s"] / baseline["step_time_median_s"],
        "peak_rss": result["peak_rss_bytes"] / baseline["peak_rss_bytes"],
        "step0_loss_abs_diff": abs(result["step0"]["loss"] - baseline["step0"]["loss"]),
    }


def model_tokens_per_pair(result: dict, pairs_per_step: int) -> float:
    """Non-pad positions the model computes per pair (a shared prompt once; TRL and the
    unshared engine: prompt + chosen + rejected with the prompt twice); nan without the step
    size. Example: 4 pairs, 3,000 real tokens per step, 0.8 model tokens per real token -> 600."""
    if not pairs_per_step:
        return float("nan")
    return (
        result.get("real_tokens_per_step", float("nan"))
        * result.get("model_tokens_per_real_token", 1.0)
        / pairs_per_step
    )


def markdown(report: dict) -> str:
    """The results as Markdown tables (one per model), ratios against TRL when it ran, and the
    shared-prompt runs against packing alone (same pairs, same rows of one micro-batch)."""
    lines = []
    pairs_per_step = report.get("settings", {}).get("pairs_per_step", 0)
    for model, runs in report["results"].items():
        lines += [
            f"#### {model}",
            "",
            "| run | real tok/s (wall) | real tok/s (CPU) | real tok/s (CPU), 1st epoch "
            "incl. precompute | padded fraction | step time median (s) | peak RSS (GiB) | "
            "step-0 loss | step-0 logps/chosen | precompute (s) | model tokens / pair | "
            "model / real tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in runs.items():
            lines.append(
                f"| {name} | {r['real_tokens_per_s']:.1f} | {r['real_tokens_per_cpu_s']:.1f} | "
                f"{r.get('real_tokens_per_cpu_s_first_epoch', float('nan')):.1f} | "
                f"{r['padded_fraction']:.3f} | {r['step_time_median_s']:.2f} | "
                f"{r['peak_rss_bytes'] / 2**30:.2f} | {r['step0']['loss']:.6f} | "
                f"{r['step0'].get('logps/chosen', float('nan')):.3f} | "
                f"{r['precompute_s']:.1f} | {model_tokens_per_pair(r, pairs_per_step):.1f} | "
                f"{r.get('model_tokens_per_real_token', 1.0):.3f} |"
            )
        if "engine+packing" in runs:
            base = runs["engine+packing"]
            for name in [n for n in runs if n.startswith("engine+shared")]:
                r = runs[name]
                speed = r["real_tokens_per_cpu_s"] / base["real_tokens_per_cpu_s"]
                work = r.get("model_tokens_per_real_token", 1.0) / base.get(
                    "model_tokens_per_real_token", 1.0
                )
                lines += [
                    "",
                    f"{name} / engine+packing: real tok/s (CPU) {speed:.2f}x, "
                    f"model tokens per pair {work:.3f}x",
                ]
        if "trl" in runs:
            lines += [
                "",
                "| run / TRL | against | tok/s (wall) | tok/s (CPU) | step time | peak RSS | "
                "step-0 loss diff |",
                "|---|---|---|---|---|---|---|",
            ]
            for name, r in runs.items():
                if name in TRL_RUNS:
                    continue
                # bf16 runs against TRL in bf16 when it ran, everything else against fp32 TRL
                against = "trl+bf16" if "bf16" in name and "trl+bf16" in runs else "trl"
                q = ratios(r, runs[against])
                lines.append(
                    f"| {name} | {against} | {q['real_tokens_per_s']:.2f}x | "
                    f"{q['real_tokens_per_cpu_s']:.2f}x | {q['step_time_median']:.2f}x | "
                    f"{q['peak_rss']:.2f}x | {q['step0_loss_abs_diff']:.1e} |"
                )
        lines += ["", "Loss per step (max |difference| from the plain engine's):", ""]
        for name, r in runs.items():
            diff = ""
            if "engine" in runs and name != "engine":
                gap = max(abs(a - b) for a, b in zip(r["losses"], runs["engine"]["losses"]))
                diff = f" (max diff {gap:.1e})"
            lines.append(f"- {name}: " + ", ".join(f"{x:.6f}" for x in r["losses"]) + diff)
        lines.append("")
    return "\n".join(lines)


def machine() -> dict:
    import torch

    load = os.getloadavg()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "")
    except OSError:
        model = ""
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_model": model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in load],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="smollm2,smollm2-4l",
        help="comma list of smollm2 (30 layers), smollm2-4l (4-layer cut) and "
        f"{MOE_PREFIX}<E> (random Qwen3-MoE with E experts)",
    )
    parser.add_argument(
        "--engines",
        default="",
        help=f"comma list of {', '.join(ALL_RUNS)}; any engine setting also "
        f"with {' or '.join(HOST_MALLOC_SUFFIXES)} (default: all on "
        "smollm2-4l; trl, engine, engine+packing+precomputed on smollm2)",
    )
    parser.add_argument(
        "--pairs", type=int, default=0, help="first N pairs (default: pairs-per-step x steps)"
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the timing")
    parser.add_argument("--pairs-per-step", type=int, default=4)
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=0,
        help="engine micro-batch (pairs; default: pairs-per-step)",
    )
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--recompute", default="", help="engine: '', 'selective' or 'full'")
    parser.add_argument("--out", default="bench_results.json")
    parser.add_argument("--markdown", default="", help="also write the tables to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(args.worker)
        result = in_scratch(run_trl if spec["run"] in TRL_RUNS else run_engine, spec)
        result["host_malloc"] = describe(trimming=result.get("heap_trims") is not None)
        Path(args.worker_out).write_text(json.dumps(result))
        return 0

    chosen = [e for e in args.engines.split(",") if e]
    unknown = [e for e in chosen if e not in ALL_RUNS and setting(e) not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; known: {ALL_RUNS}")
    import importlib.util

    has_trl = importlib.util.find_spec("trl") is not None
    if not has_trl:
        print("trl is not installed (pip install -e .[bench]): engine runs only", flush=True)
    base = {
        k: getattr(args, k)
        for k in (
            "steps",
            "warmup",
            "pairs_per_step",
            "max_length",
            "max_prompt_length",
            "beta",
            "lr",
            "seed",
            "threads",
            "recompute",
        )
    }
    base["pairs"] = args.pairs or args.pairs_per_step * args.steps
    base["micro_batch_size"] = args.micro_batch_size or args.pairs_per_step
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": base,
        "machine": machine(),
        "results": {},
    }
    started = time.time()
    for model in [m for m in args.models.split(",") if m]:
        path = model_folder(model)
        bench_pairs(base["pairs"], base["max_length"], base["max_prompt_length"])  # warm cache
        report["results"][model] = {}
        runs = chosen or DEFAULT_RUNS.get(model, ALL_RUNS)
        for run in [r for r in runs if has_trl or r not in TRL_RUNS]:
            t0 = time.time()
            # A run is silent for minutes (its output is kept for a failure): say what runs.
            print(f"{model:11s} {run:27s} running {base['steps']} steps ...", flush=True)
            result = _child({**base, "model": model, "model_path": path, "run": run})
            report["results"][model][run] = result
            print(
                f"{model:11s} {run:27s} {result['real_tokens_per_s']:8.1f} tok/s wall "
                f"{result['real_tokens_per_cpu_s']:8.1f} tok/s cpu  padded "
                f"{result['padded_fraction']:.3f}  step {result['step_time_median_s']:.2f} s  "
                f"rss {result['peak_rss_bytes'] / 2**30:.2f} GiB  loss0 "
                f"{result['step0']['loss']:.6f}  ({time.time() - t0:.0f} s)",
                flush=True,
            )
            write_json_atomic(args.out, report)
    finish(report, started, args.out, args.markdown, markdown(report))
    return 0


def finish(report: dict, started: float, out: str, markdown_path: str, text: str) -> None:
    """A bench's end: the load average at the end and the total seconds into ``report``, the
    JSON written to ``out``, the tables ``text`` printed (and written to ``markdown_path``); both
    files atomically, their folders created (a fresh checkout has no ``runs/``)."""
    report["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["total_s"] = time.time() - started
    write_json_atomic(out, report)
    print(text)
    if markdown_path:
        write_text_atomic(markdown_path, text)


if __name__ == "__main__":
    sys.exit(main())
