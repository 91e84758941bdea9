"""The DPO step at every parallel layout: ln 2 at step 0 and identical numbers everywhere.

Every layout runs the real ``Trainer`` (batch builder, device crossing, reference model,
distributed optimizer). Weights come from one distributed checkpoint written at TP 1 x PP 1 and
loaded at each layout (megatron-core reshards), so every layout starts from the same model. The
interleaved (virtual) pipeline at PP 2 is included: it is where gloo's in-order p2p matching once
silently swapped activations and gradients.
"""

import math

import pytest

from tests.engine import (
    assert_step_zero_is_exact,
    owns_results,
    step_record,
    tiny_pairs,
    tiny_trainer,
    train_step_against_reference,
)
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow

LAYOUTS = [  # (TP, PP, DP, sequence_parallel, virtual pipeline stages)
    (1, 1, 1, False, None),
    (2, 1, 1, True, None),
    (1, 2, 1, False, None),
    (1, 2, 1, False, 2),
    (1, 1, 2, False, None),
    (2, 2, 1, False, None),
    (2, 2, 2, True, None),
]
GLOBAL_PAIRS = 8


def _run_layout(ckpt_dir, tp, pp, sp, micro_batch_size, vpp=None, steps=2, loss=None):
    """``steps`` optimizer steps of the real trainer over the same 8 pairs per step."""
    from megatron.core import parallel_state as ps

    trainer = tiny_trainer(
        tiny_pairs(GLOBAL_PAIRS),
        tp=tp,
        pp=pp,
        sp=sp,
        vpp=vpp,
        load=ckpt_dir,
        micro_batch_size=micro_batch_size,
        global_batch_size=GLOBAL_PAIRS,
        steps=steps,
        lr=1e-3,
        loss=loss,
        seed=11,
    )
    history = [step_record(*train_step_against_reference(trainer))]
    history += [step_record(*trainer.train_step()) for _ in range(steps - 1)]
    return {"dp_rank": ps.get_data_parallel_rank(), "owner": owns_results(), "history": history}


def _per_pair(results, step, key):
    """Stitch the per-pair values of every DP rank back into global pair order."""
    owners = sorted((r for r in results if r["owner"]), key=lambda r: r["dp_rank"])
    return [v for r in owners for v in r["history"][step]["per_item"][key]]


@pytest.fixture(scope="module")
def baseline(initial_checkpoint):
    return run_ranks(
        _run_layout,
        world_size=1,
        ckpt_dir=initial_checkpoint,
        tp=1,
        pp=1,
        sp=False,
        micro_batch_size=2,
    )


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("tp, pp, dp, sp, vpp", LAYOUTS)
def test_layout_matches_single_rank(initial_checkpoint, baseline, tp, pp, dp, sp, vpp):
    results = run_ranks(
        _run_layout,
        world_size=tp * pp * dp,
        ckpt_dir=initial_checkpoint,
        tp=tp,
        pp=pp,
        sp=sp,
        vpp=vpp,
        micro_batch_size=2,
    )
    step0 = results[0]["history"][0]["metrics"]
    # Step 0, policy == reference: loss exactly ln 2, zero rewards, zero (strict) accuracy, and
    # on every last-stage rank the policy's per-token log-probs are the reference's bit for bit.
    assert abs(step0["loss"] - math.log(2)) < 1e-5
    for r in results:
        if r["owner"]:
            assert_step_zero_is_exact(r["history"][0])
    for step in range(2):  # step 1 runs after one distributed-optimizer update
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert _rel(got["metrics"][key], want["metrics"][key]) < 1e-5, (step, key)
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5
        for key in ("logps/chosen", "logps/rejected"):
            for a, b in zip(
                _per_pair(results, step, key), _per_pair(baseline, step, key), strict=True
            ):
                assert _rel(a, b) < 1e-5
    # Every rank reports the same metrics (shared from the last stage, reduced over DP).
    assert all(r["history"][1]["metrics"] == results[0]["history"][1]["metrics"] for r in results)


@pytest.mark.parametrize("micro_batch_size", [1, 4, 8])
def test_micro_batch_size_and_accumulation_do_not_change_loss_or_gradient(
    initial_checkpoint, baseline, micro_batch_size
):
    results = run_ranks(
        _run_layout,
        world_size=1,
        ckpt_dir=initial_checkpoint,
        tp=1,
        pp=1,
        sp=False,
        micro_batch_size=micro_batch_size,
    )
    for step in range(2):
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        assert _rel(got["metrics"]["loss"], want["metrics"]["loss"]) < 1e-5
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5


def test_loss_is_the_mean_over_global_pairs(baseline):
    """The reported loss equals the mean of the per-pair losses (hand reduction)."""
    step1 = baseline[0]["history"][1]
    per_item = step1["per_item"]["loss"]
    assert len(per_item) == GLOBAL_PAIRS
    assert _rel(step1["metrics"]["loss"], sum(per_item) / GLOBAL_PAIRS) < 1e-6
    margins = [
        c - r
        for c, r in zip(step1["per_item"]["rewards/chosen"], step1["per_item"]["rewards/rejected"])
    ]
    for m, loss in zip(margins, per_item):  # sigmoid DPO: -log sigmoid(margin)
        assert abs(loss - math.log1p(math.exp(-m))) < 1e-5
