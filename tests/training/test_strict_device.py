"""The engine on a device that is not the host: every feature takes a full step on ``strict:0``
(``tests/strict_device.py``), where an op that mixes host and device tensors raises as on CUDA
and a collective refuses a host tensor as NCCL does.

On the CPU the engine's device is the host, so a placement check there proves nothing. On
``strict:0`` it is not: megatron-core takes its GPU branch (weights initialised on the device,
``use_cpu_initialization=False``), and a parameter, buffer, batch or flag left on the host fails
the run where a GPU run would. One rank-world of 2 ranks runs each feature for one step, from
data loading to the checkpoint save; one rank runs the engine again with each old defect of
``test_device_boundary.py`` put back (the model not placed: its norms left on the host; a batch
not moved; host flags and counts in collectives), and each must fail there, in the module that
made the host tensor (the step's results shared along the pipeline from a host tensor: on 2
ranks at PP 2, ``PIPELINE_DEFECTS``).
"""

from __future__ import annotations

import importlib
import math
import time
import traceback
from pathlib import Path

import pytest

from tests.multirank import run_ranks
from tests.training.test_device_boundary import DEFECTS, PIPELINE_DEFECTS
from tests.training.test_lifecycle import model_tensors, read_metrics

pytestmark = pytest.mark.slow

LAYOUT_KEYS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
}
EVAL = [
    "data.eval_fraction=0.2",
    "train.sample_during_eval=true",
    "train.eval_num_samples=1",
    "train.eval_sample_max_new_tokens=2",
    "train.eval_iters=1",
]
PACKED = ["packing.enabled=true"]
# Each plan: one step of the real trainer on the fixture data (tokenizer, reader, collate),
# policy + reference (a frozen model, the LoRA base or the precomputed table), the end-of-run
# checkpoint save, and where noted the evaluation with greedy samples.
PLANS = {
    "padded, PP 2, evaluation": ({"pp": 2}, EVAL),
    "packed, TP 2": ({"tp": 2}, PACKED),
    "shared prompt, TP 2": ({"tp": 2}, [*PACKED, "packing.share_prompt=true"]),
    "LoRA, PP 2": ({"pp": 2}, ["lora.enabled=true", "lora.rank=4", "lora.alpha=8"]),
    "MoE with QK norms, EP 2": (
        {"ep": 2},
        ["model.num_experts=4", "model.moe_router_topk=2", "model.qk_layernorm=true"],
    ),
    "context parallel, CP 2": ({"cp": 2}, []),
    "precomputed reference, packed, TP 2": ({"tp": 2}, [*PACKED, "reference.mode=precomputed"]),
    "bf16, precomputed reference, PP 2": (
        {"pp": 2},
        ["model.params_dtype=bfloat16", "reference.mode=precomputed"],
    ),
    "bf16 reward model, TP 2": (
        {"tp": 2},
        ["model.params_dtype=bfloat16", "loss.name=bradley_terry"],
    ),
    "GPT-2 shape (learned positions, LayerNorm), PP 2": (
        {"pp": 2},
        [
            "model.position_embedding_type=learned_absolute",
            "model.normalization=LayerNorm",
            "model.activation=gelu",
            "model.add_bias_linear=true",
        ],
    ),
}


# The old defects of test_device_boundary.py, each put back by replacing one module attribute,
# and the file the strict device must stop the run in (the innermost engine or megatron-core
# frame of its error). Without models.gpt.place_chunk, megatron-core's GPU branch makes every
# weight on the device except those made by plain factories: the norms (models/norms.py's
# torch.ones), QK norms and learned positions. The policy's are moved by DDP (they train); the
# frozen reference's first norm then meets a device activation, as on a GPU.
NORMS_ON_HOST = "model not placed: norms left on the host"
STRICT_DEFECTS = {name: defect for name, defect in DEFECTS.items() if name != "model not placed"}
STRICT_DEFECTS[NORMS_ON_HOST] = (*DEFECTS["model not placed"][:3], "dpo_megatron/models/norms.py")


def _run_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _config(root: str, name: str, layout: dict, *overrides: str):
    from tests.training.test_lifecycle import tiny_config, write_fixture

    data_file, tok_dir = write_fixture(Path(root))
    return tiny_config(
        f"{root}/{_run_name(name)}",
        data_file,
        tok_dir,
        "train.train_iters=1",
        "train.global_batch_size=2",
        f"reference.cache_dir={root}/cache",
        *(f"parallel.{LAYOUT_KEYS[k]}={v}" for k, v in layout.items()),
        *overrides,
    )


def _innermost(error: BaseException) -> str:
    """The innermost engine or megatron-core frame of ``error``'s traceback, ``path:line``."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if ("dpo_megatron" in f.filename or "megatron/core" in f.filename)
        and "compat/cuda_on_cpu.py" not in f.filename
    ]  # its mode only passes calls on
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _off_device(trainer) -> list[str]:
    """Parameters and buffers of the policy and reference chunks that are not on strict:0."""
    from tests.strict_device import is_strict

    chunks = list(trainer.policy) + list(getattr(trainer.reference, "chunks", None) or [])
    return [
        f"chunk {i}: {name} on {t.device}"
        for i, chunk in enumerate(chunks)
        for name, t in list(chunk.named_parameters()) + list(chunk.named_buffers())
        if not is_strict(t)
    ]


def _run_plans(root: str, names: list[str]) -> dict[str, dict]:
    """Each plan on these ranks, on strict:0: its seconds, the device, what is off the device,
    and the absolute sum of the policy's parameters (for the checkpoint check)."""
    import torch
    from megatron.core import parallel_state as ps

    from dpo_megatron.training.trainer import Trainer
    from tests.strict_device import StrictDevice

    out = {}
    with StrictDevice():
        for name in names:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()  # the next plan has another layout
            layout, overrides = PLANS[name]
            start = time.perf_counter()
            try:
                trainer = Trainer(_config(root, name, layout, *overrides))
                trainer.train()
            except Exception as e:
                raise RuntimeError(f"{name}: {type(e).__name__} at {_innermost(e)}: {e}") from e
            with torch.no_grad():
                policy_abs_sum = sum(
                    float(p.double().abs().sum().cpu())
                    for chunk in trainer.policy
                    for p in chunk.parameters()
                )
            out[name] = {
                "seconds": time.perf_counter() - start,
                "device": str(trainer.device),
                "off_device": _off_device(trainer),
                "policy_abs_sum": policy_abs_sum,
            }
    return out


@pytest.fixture(scope="module")
def plan_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict_plans")
    return root, run_ranks(_run_plans, world_size=2, root=str(root), names=list(PLANS))


@pytest.mark.parametrize("name", list(PLANS))
def test_each_feature_takes_a_step_on_a_device_that_is_not_the_host(plan_results, name):
    root, results = plan_results
    for rank, result in enumerate(results):
        assert result[name]["device"] == "strict:0", (rank, result[name])
        assert result[name]["off_device"] == [], (rank, result[name]["off_device"][:5])
    first = read_metrics(root / _run_name(name))[1]
    assert abs(first["loss"] - math.log(2)) < 1e-6  # policy == reference at step 1
    assert math.isfinite(first["grad_norm"]) and first["grad_norm"] > 0


def test_the_checkpoint_holds_the_device_values(plan_results):
    """The save reads the strict tensors' values (PP 2, no weight on two ranks): the absolute sum
    of every model tensor in the checkpoint is the policy's on the two stages."""
    root, results = plan_results
    name = "padded, PP 2, evaluation"
    saved = model_tensors(root / _run_name(name) / "checkpoints" / "iter_0000001")
    in_checkpoint = sum(float(abs(v.astype("float64")).sum()) for v in saved.values())
    on_device = sum(result[name]["policy_abs_sum"] for result in results)
    assert on_device > 0
    assert abs(in_checkpoint - on_device) <= 1e-9 * on_device


def _defect_runs(root: str, names: list[str], overrides: tuple = ()) -> dict[str, dict]:
    """One run per defect, each put back alone, on strict:0: the error (type, innermost engine
    or megatron-core frame, message), or None when the run finished."""
    from dpo_megatron.training.trainer import Trainer
    from tests.strict_device import StrictDevice

    out = {}
    with StrictDevice():
        for name in names:
            module_name, attr, replacement, _ = STRICT_DEFECTS[name]
            module = importlib.import_module(module_name)
            saved = getattr(module, attr)
            setattr(module, attr, replacement)
            extra = ["reference.mode=precomputed"] if "cache" in name else EVAL
            try:
                Trainer(_config(root, name, {}, *extra, *overrides)).train()
                out[name] = None
            except Exception as e:
                out[name] = {"type": type(e).__name__, "where": _innermost(e), "message": str(e)}
            finally:
                setattr(module, attr, saved)
    return out


@pytest.fixture(scope="module")
def defect_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict_defects")
    single = [n for n in STRICT_DEFECTS if n not in PIPELINE_DEFECTS]
    results = run_ranks(_defect_runs, world_size=1, root=str(root), names=single)[0]
    # A defect met only between pipeline stages: 2 ranks at PP 2; the error of either rank.
    piped = run_ranks(
        _defect_runs,
        world_size=2,
        root=str(root),
        names=sorted(PIPELINE_DEFECTS),
        overrides=["parallel.pipeline_model_parallel_size=2"],
    )
    for name in PIPELINE_DEFECTS:
        results[name] = next((r[name] for r in piped if r[name] is not None), None)
    return results


@pytest.mark.parametrize("defect", sorted(STRICT_DEFECTS))
def test_each_old_defect_fails_on_the_strict_device(defect_results, defect):
    error = defect_results[defect]
    assert error is not None, f"{defect}: the run finished on strict:0"
    assert error["type"] == "StrictDeviceError", error
    assert STRICT_DEFECTS[defect][3] in error["where"], error
