"""compat.torch_adam_resume: without it megatron-core 0.16 cannot resume its distributed
optimizer on torch's Adam (a canary: when an upgrade fixes megatron-core, the first test fails
and the patch can go); with it the resumed Adam state is the saved one, step counters per
parameter."""

import pytest

from tests.engine import tiny_pairs, tiny_trainer
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow


def _save_then_resume(run_dir, patched):
    from dpo_megatron.compat import torch_adam_resume

    first = tiny_trainer(tiny_pairs(4, seed=2), run_dir=run_dir, steps=2, global_batch_size=4)
    first.train_step()
    first.checkpointer.save(first.counters)
    if not patched:
        torch_adam_resume.needed = lambda optimizer: False
    try:
        second = tiny_trainer(
            tiny_pairs(4, seed=2), run_dir=run_dir, steps=2, global_batch_size=4, resume="auto"
        )
    except Exception:  # the canary's expected failure
        import traceback

        return {"error": traceback.format_exc()}
    steps = []
    inner = (
        second.optimizer.chained_optimizers[0].optimizer
        if hasattr(second.optimizer, "chained_optimizers")
        else second.optimizer.optimizer
    )
    for state in inner.state.values():
        steps.append((float(state["step"]), id(state["step"])))
    return {"steps": steps}


def test_without_the_patch_megatron_core_016_cannot_resume(tmp_path):
    out = run_ranks(_save_then_resume, world_size=1, run_dir=str(tmp_path), patched=False)[0]
    # Fault 1 (no Adam state before the first step) stops the load inside megatron-core.
    assert "error" in out and "megatron/core/optimizer/distrib_optimizer.py" in out["error"], out


def test_with_the_patch_every_parameter_keeps_its_own_step(tmp_path):
    out = run_ranks(_save_then_resume, world_size=1, run_dir=str(tmp_path), patched=True)[0]
    assert out["steps"] and all(step == 1.0 for step, _ in out["steps"])  # one update saved
    assert len({ident for _, ident in out["steps"]}) == len(out["steps"])  # not one shared tensor
