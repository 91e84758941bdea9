"""The engine on a device that is not the host: every feature takes a full step on ``strict:0``
(``tests/strict_device.py``), where an op that mixes host and device tensors raises as on CUDA
and a collective refuses a host tensor as NCCL does.

On the CPU the engine's device is the host, so a placement check there proves nothing. On
``strict:0`` it is not: megatron-core takes its GPU branch (weights initialised on the device),
and a parameter, buffer, batch or flag left on the host fails the run where a GPU run would.
One rank-world of 2 ranks runs each feature for one step, from data loading to the checkpoint
save; one rank runs the engine again with each old defect put back, and each must fail there.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import pytest

from tests.multirank import run_ranks
from tests.training.test_device_boundary import DEFECTS

pytestmark = pytest.mark.slow

# Each plan: one step of the real trainer on the fixture data (tokenizer, reader, collate),
# policy + reference, evaluation with greedy samples where noted, and the end-of-run save.
LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "cp": "context_parallel_size", "ep": "expert_model_parallel_size"}
EVAL = ["data.eval_fraction=0.2", "train.sample_during_eval=true", "train.eval_num_samples=1",
        "train.eval_sample_max_new_tokens=2", "train.eval_iters=1"]
PACKED = ["packing.enabled=true"]
PLANS = {
    "padded, PP 2, evaluation": ({"pp": 2}, EVAL),
    "packed, TP 2": ({"tp": 2}, PACKED),
    "shared prompt, TP 2": ({"tp": 2}, [*PACKED, "packing.share_prompt=true"]),
    "LoRA, PP 2": ({"pp": 2}, ["lora.enabled=true", "lora.rank=4", "lora.alpha=8"]),
    "MoE with QK norms, EP 2": ({"ep": 2}, ["model.num_experts=4", "model.moe_router_topk=2",
                                            "model.qk_layernorm=true"]),
    "context parallel, CP 2": ({"cp": 2}, []),
    "precomputed reference, packed, TP 2": ({"tp": 2}, [*PACKED, "reference.mode=precomputed"]),
    "GPT-2 shape (learned positions, LayerNorm), PP 2": (
        {"pp": 2}, ["model.position_embedding_type=learned_absolute",
                    "model.normalization=LayerNorm", "model.activation=gelu",
                    "model.add_bias_linear=true"]),
}


def _config(root: str, name: str, layout: dict, *overrides: str):
    from tests.training.test_lifecycle import tiny_config, write_fixture

    data_file, tok_dir = write_fixture(Path(root))
    return tiny_config(
        f"{root}/{name}", data_file, tok_dir, "train.train_iters=1",
        "train.global_batch_size=2", f"reference.cache_dir={root}/cache",
        *(f"parallel.{LAYOUT_KEYS[k]}={v}" for k, v in layout.items()), *overrides)


def _innermost(error: BaseException) -> str:
    """The innermost engine or megatron-core frame of ``error``'s traceback, ``path:line``."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if ("dpo_megatron" in f.filename or "megatron/core" in f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _run_plans(root: str, names: list[str]) -> dict[str, float]:
    """Each plan's run on ``strict:0`` on these ranks; seconds per plan."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.training.trainer import Trainer
    from tests.strict_device import StrictDevice

    seconds = {}
    with StrictDevice():
        for name in names:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()  # the next plan has another layout
            layout, overrides = PLANS[name]
            start = time.perf_counter()
            try:
                Trainer(_config(root, name.split(",")[0].replace(" ", "_"), layout,
                                *overrides)).train()
            except Exception as e:
                raise RuntimeError(f"{name}: {type(e).__name__} at {_innermost(e)}: {e}") from e
            seconds[name] = time.perf_counter() - start
    return seconds


def test_every_feature_takes_a_step_on_a_device_that_is_not_the_host(tmp_path):
    seconds = run_ranks(_run_plans, world_size=2, root=str(tmp_path), names=list(PLANS))[0]
    assert set(seconds) == set(PLANS)
