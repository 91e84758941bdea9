"""LoRA DPO through the real ``Trainer``: the frozen base is the reference (no second model), only
the adapters are in the optimizer, step 0 is exactly ln 2, and every layout (TP + SP, PP,
interleaved PP, TP x PP, DP), activation recompute and packing give the single-rank run's
losses and gradient norms. ``reference.mode=precomputed`` runs the base once.

Base weights come from one distributed checkpoint written at TP 1 x PP 1 and loaded at each
layout, so every layout adapts the same model; adapters are drawn layout-independently.

The cases of one world size run one after the other in one rank-world (``run_cases``): the
fast tests' single-rank cases, the slow ones', and the 2- and 4-rank layouts.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.engine import (
    TINY,
    assert_step_zero_is_exact,
    engine_config,
    owns_results,
    step_record,
    tiny_pairs,
    train_step_against_reference,
)
from tests.multirank import run_cases

GLOBAL_PAIRS = 8
LORA = dict(enabled=True, rank=4, alpha=8.0)


def lora_trainer(pairs, eval_pairs=(), lora=None, export_hf="none", **config):
    """``tests.engine.tiny_trainer`` with a ``lora`` section (dict of ``LoraConfig`` fields);
    ``export_hf``: ``checkpoint.export_hf`` (written in fp32)."""
    from dpo_megatron.models.lora_config import LoraConfig
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer

    cfg = engine_config(**config)
    checkpoint = dataclasses.replace(cfg.checkpoint, export_hf=export_hf, export_dtype="float32")
    cfg = dataclasses.replace(cfg, lora=LoraConfig(**(lora or LORA)), checkpoint=checkpoint)
    return Trainer(cfg, data=RunData(list(pairs), list(eval_pairs), 0))


def _run(ckpt_dir, steps=3, lora=None, **config):
    """``steps`` LoRA steps; per step the loss, margins and grad norm, plus what was built."""
    import dpo_megatron.training.run_models as run_models
    from dpo_megatron.models.lora import adapter_parameter_ids

    built = []
    original = run_models.build_model_chunks
    run_models.build_model_chunks = lambda *a, **k: (built.append(1), original(*a, **k))[1]
    config = {
        "micro_batch_size": 2,
        "global_batch_size": GLOBAL_PAIRS,
        "lr": 1e-2,
        "seed": 11,
        **config,
    }
    try:
        trainer = lora_trainer(
            tiny_pairs(GLOBAL_PAIRS), lora=lora, load=ckpt_dir, steps=steps, **config
        )
    finally:  # the next case in these ranks counts its own builds
        run_models.build_model_chunks = original
    history = []
    for step in range(steps):
        if step == 0:
            out, batch, equal = train_step_against_reference(trainer)
            step0 = step_record(out, batch, equal)
        else:
            out, _ = trainer.train_step()
        history.append(
            {
                k: out.metrics[k]
                for k in ("loss", "rewards/margins", "rewards/chosen", "logps/chosen")
            }
            | {"grad_norm": out.grad_norm}
        )
    adapter_ids = set().union(*(adapter_parameter_ids(c) for c in trainer.policy))
    optimized = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    trainer.close()
    return {
        "history": history,
        "step0": step0,
        "owner": owns_results(),
        "models_built": len(built),
        "reference": type(trainer.reference).__name__,
        "reference_is_policy": trainer.reference is not None
        and all(r is p.module for r, p in zip(trainer.reference.chunks, trainer.policy)),
        # Only adapters train and sit in the (distributed) optimizer and the DDP grad buffers
        # (the distributed optimizer holds shard views: compare sizes, at DP 1 the whole).
        "optimized_numel": sum(p.numel() for p in optimized),
        "trainable_are_adapters": {
            id(p) for c in trainer.policy for p in c.parameters() if p.requires_grad
        }
        == adapter_ids,
        "grad_buffer_numel": sum(b.grad_data.numel() for c in trainer.policy for b in c.buffers),
        "adapter_numel": sum(
            p.numel() for c in trainer.policy for p in c.parameters() if id(p) in adapter_ids
        ),
    }


LAYOUTS = [  # (TP, PP, DP, sequence parallel, virtual stages)
    (2, 1, 1, True, None),
    (1, 2, 1, False, None),
    (1, 2, 1, False, 2),
    (1, 1, 2, False, None),
]
TP2PP2 = (2, 2, 1, False, None)

SETTINGS = [
    {
        "model": {
            **TINY,
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    },
    {"model": {**TINY, "recompute_granularity": "selective"}},
    {"packing": True},
]


@pytest.fixture(scope="module")
def quick_runs(initial_checkpoint):
    """The fast tests' single-rank cases: the baseline and adapter dropout."""
    ckpt = {"ckpt_dir": initial_checkpoint}
    return run_cases(1, {"baseline": (_run, ckpt), "dropout": (_dropout_run, ckpt)})


@pytest.fixture(scope="module")
def baseline(quick_runs):
    return quick_runs["baseline"][0]


@pytest.fixture(scope="module")
def slow_runs(initial_checkpoint, tmp_path_factory):
    """The slow tests' cases: single-rank settings and the precomputed reference, then every
    layout (2 ranks, then 4)."""
    ckpt = {"ckpt_dir": initial_checkpoint}
    runs = run_cases(
        1,
        {
            **{f"setting{i}": (_run, {**ckpt, **setting}) for i, setting in enumerate(SETTINGS)},
            "precomputed": (
                _precomputed_then_full,
                {**ckpt, "cache_dir": str(tmp_path_factory.mktemp("lora_cache"))},
            ),
        },
    )
    for world in (2, 4):
        runs.update(
            run_cases(
                world,
                {
                    f"layout{layout}": (_run, dict(**ckpt, tp=tp, pp=pp, sp=sp, vpp=vpp))
                    for layout in LAYOUTS + [TP2PP2]
                    for tp, pp, dp, sp, vpp in [layout]
                    if tp * pp * dp == world
                },
            )
        )
    return runs


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_steps(got, want, tol=1e-5):
    for step, (g, w) in enumerate(zip(got["history"], want["history"], strict=True)):
        for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
            assert _rel(g[key], w[key]) < tol, (step, key, g[key], w[key])


def test_single_rank_lora_trains_only_adapters_against_the_base(baseline):
    h = baseline["history"]
    # Step 0: the policy (B = 0) is the base, the reference: ln 2, zero rewards.
    assert abs(h[0]["loss"] - math.log(2)) < 1e-6
    assert_step_zero_is_exact(baseline["step0"])
    assert h[2]["loss"] < h[0]["loss"] - 1e-3  # the adapters learn
    assert h[1]["rewards/margins"] != 0
    # One model built (the policy); the reference is the policy's own modules.
    assert baseline["models_built"] == 1
    assert baseline["reference"] == "BaseModelReference" and baseline["reference_is_policy"]
    assert baseline["trainable_are_adapters"]
    assert baseline["optimized_numel"] == baseline["adapter_numel"] == 13312  # 4 x 3328, by hand
    # Grad buffers hold the adapters (plus alignment padding), not the 4-layer base.
    assert (
        baseline["adapter_numel"] <= baseline["grad_buffer_numel"] < 2 * baseline["adapter_numel"]
    )


@pytest.mark.slow
def test_step0_is_ln2_with_no_reference_model_at_tp2_pp2(slow_runs, baseline):
    results = slow_runs[f"layout{TP2PP2}"]
    for r in results:
        assert abs(r["history"][0]["loss"] - math.log(2)) < 1e-6
        if r["owner"]:
            assert_step_zero_is_exact(r["step0"])
        assert r["models_built"] == 1 and r["reference"] == "BaseModelReference"
        assert r["reference_is_policy"] and r["trainable_are_adapters"]
    _assert_same_steps(results[0], baseline)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, dp, sp, vpp", LAYOUTS)
def test_layout_matches_single_rank(slow_runs, baseline, tp, pp, dp, sp, vpp):
    results = slow_runs[f"layout{(tp, pp, dp, sp, vpp)}"]
    assert len(results) == tp * pp * dp
    for r in results:
        _assert_same_steps(r, baseline)
        if r["owner"]:
            assert_step_zero_is_exact(r["step0"])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SETTINGS)))
def test_recompute_and_packing_give_the_same_steps(slow_runs, baseline, index):
    # Full recompute checkpoints each layer: without the embedding output requiring grad the
    # adapters inside would get no gradient (grad norm 0).
    _assert_same_steps(slow_runs[f"setting{index}"][0], baseline)
    assert_step_zero_is_exact(slow_runs[f"setting{index}"][0]["step0"])


def _precomputed_then_full(ckpt_dir, cache_dir):
    """LoRA with a precomputed reference (one pass of the base), then a full-DPO run on the same
    base and cache: its reference is that base, so it reads the LoRA run's table."""
    import dpo_megatron.training.step as step_module
    from tests.engine import tiny_trainer

    calls = []
    original = step_module.reference_token_logps
    step_module.reference_token_logps = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    common = dict(
        load=ckpt_dir,
        micro_batch_size=2,
        global_batch_size=GLOBAL_PAIRS,
        lr=1e-2,
        seed=11,
        steps=3,
        reference_mode="precomputed",
        cache_dir=cache_dir,
    )
    try:
        trainer = lora_trainer(tiny_pairs(GLOBAL_PAIRS), **common)
        passes_before = len(calls)
        losses = [trainer.train_step()[0].metrics["loss"] for _ in range(3)]
        out = {
            "losses": losses,
            "precompute_passes": passes_before,
            "training_passes": len(calls) - passes_before,
            "reference_held": trainer.reference is not None,
            "policy_intact": all(p.numel() > 0 for c in trainer.policy for p in c.parameters()),
        }
        trainer.close()
        calls.clear()
        full = tiny_trainer(tiny_pairs(GLOBAL_PAIRS), **common)
        out["full_run_passes"] = len(calls)
        out["full_step0"] = full.train_step()[0].metrics["loss"]
        full.close()
    finally:  # the next case in these ranks runs the real function
        step_module.reference_token_logps = original
    return out


@pytest.mark.slow
def test_precomputed_reference_runs_the_base_once(slow_runs, baseline):
    out = slow_runs["precomputed"][0]
    for a, b in zip(out["losses"], [s["loss"] for s in baseline["history"]], strict=True):
        assert _rel(a, b) < 1e-5
    # one pass: the first epoch's one step (8 pairs, 4 micro-batches), as training groups them
    assert out["precompute_passes"] == 1 and out["training_passes"] == 0
    assert not out["reference_held"] and out["policy_intact"]  # released nothing of the policy
    # The table is keyed by the frozen (base) weights: the full run on that base shares it.
    assert out["full_run_passes"] == 0 and abs(out["full_step0"] - math.log(2)) < 1e-6


def _dropout_run(ckpt_dir):
    trainer = lora_trainer(
        tiny_pairs(GLOBAL_PAIRS),
        eval_pairs=tiny_pairs(4),
        load=ckpt_dir,
        micro_batch_size=2,
        global_batch_size=GLOBAL_PAIRS,
        lr=1e-2,
        seed=11,
        steps=2,
        lora={**LORA, "dropout": 0.5},
    )
    losses = [trainer.train_step()[0].metrics["loss"] for _ in range(2)]
    out = losses, trainer.evaluate(2)["loss"], trainer.evaluate(2)["loss"]
    trainer.close()
    return out


def test_adapter_dropout_trains_and_is_off_in_forward_only_passes(quick_runs, baseline):
    losses, eval_a, eval_b = quick_runs["dropout"][0]
    assert abs(losses[0] - math.log(2)) < 1e-6  # B = 0: dropout on the input changes nothing
    assert math.isfinite(losses[1]) and losses[1] != baseline["history"][1]["loss"]
    assert eval_a == eval_b  # evaluation runs in eval mode: deterministic


def test_bench_lora_settings_are_lora_dpo_rank_16_on_all_targets(tmp_path):
    from tests.test_bench import bench

    spec = {
        "run": "lora",
        "model_path": "/nonexistent",
        "recompute": "",
        "beta": 0.1,
        "lr": 1e-6,
        "steps": 2,
        "pairs_per_step": 4,
        "micro_batch_size": 4,
        "seed": 1,
    }
    cfg = bench.engine_config(spec, str(tmp_path))
    assert cfg.lora.enabled and cfg.lora.rank == 16 and cfg.lora.alpha == 32
    assert sorted(cfg.lora.target_modules) == sorted(
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    assert cfg.reference.mode == "model" and not cfg.packing.enabled
    recompute = bench.engine_config({**spec, "run": "lora+recompute"}, str(tmp_path))
    assert recompute.lora.enabled and recompute.model.recompute_granularity == "full"
    assert not bench.engine_config({**spec, "run": "engine"}, str(tmp_path)).lora.enabled
