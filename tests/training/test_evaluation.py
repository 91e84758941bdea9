"""Evaluation covers every eval pair, with a smaller last batch: with 10 eval pairs and
``train.global_batch_size=4`` the means are those of all 10 pairs (cutting the split into whole
global batches would leave the last 2 out and report the means of 8).

All cases run in two rank-worlds (one of 1 rank, one of 2: the module fixture ``runs``).
"""

import pytest

from dpo_megatron.training.evaluation import eval_micro_batch_indices
from tests.engine import random_pairs, tiny_trainer
from tests.multirank import run_cases

EVAL_PAIRS = 10


def test_micro_batch_indices_cover_every_item_once():
    for num, gbs, mbs, dp in [
        (10, 4, 2, 1),
        (10, 4, 2, 2),
        (10, 4, 1, 2),
        (7, 4, 2, 2),
        (3, 8, 2, 2),
    ]:
        seen = [
            i
            for rank in range(dp)
            for step in eval_micro_batch_indices(num, gbs, mbs, rank, dp)
            for micro in step
            for i in micro
        ]
        assert sorted(seen) == list(range(num)), (num, gbs, mbs, dp)


def _evaluate(global_batch_size, micro_batch_size, num_eval=EVAL_PAIRS):
    """Forward-only eval metrics of the untrained tiny model over the first ``num_eval`` of the
    10 eval pairs."""
    pairs = random_pairs(
        EVAL_PAIRS + 4, seed=5, lengths=lambda i: (3 + i % 5, 2 + i % 4, 4 - i % 3)
    )
    trainer = tiny_trainer(
        pairs[:4],
        pairs[4 : 4 + num_eval],
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        steps=1,
        seed=3,
    )
    return _close_after(
        trainer, trainer.evaluator.run(trainer.policy, trainer.reference, trainer.loss_fn)
    )


def _close_after(trainer, result):
    trainer.close()  # the next case in these ranks builds its own
    return result


@pytest.fixture(scope="module")
def runs(initial_checkpoint):
    """Every case's per-rank eval metrics by name: ``batched{w}`` (global batch 4 on ``w``
    ranks), ``whole`` (one batch of 10), ``first8``, ``vpp_{mode}`` (PP 2 x VPP 2) and
    ``one_{mode}`` (one stage) for both reference modes."""
    single = {
        "batched1": (_evaluate, dict(global_batch_size=4, micro_batch_size=2)),
        "whole": (_evaluate, dict(global_batch_size=10, micro_batch_size=10)),
        "first8": (_evaluate, dict(global_batch_size=8, micro_batch_size=8, num_eval=8)),
    }
    double = {"batched2": (_evaluate, dict(global_batch_size=4, micro_batch_size=1))}
    for mode in REFERENCE_MODES:
        layout = dict(ckpt_dir=initial_checkpoint, reference_mode=mode)
        single[f"one_{mode}"] = (_evaluate_layout, dict(**layout, pp=1, vpp=None))
        double[f"vpp_{mode}"] = (_evaluate_layout, dict(**layout, pp=2, vpp=2))
    return {**run_cases(1, single), **run_cases(2, double)}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_ten_eval_pairs_with_global_batch_four_are_all_evaluated(runs, world_size):
    """Global batches 4 + 4 + 2 (on DP 2: shares 2, 2 and 1 per rank) give the same means as one
    batch of all 10, and differ from the mean of the first 8 pairs (what the old code reported)."""
    batched = runs[f"batched{world_size}"]
    assert len(batched) == world_size
    whole, first8 = runs["whole"][0], runs["first8"][0]
    assert batched[0].keys() == whole.keys() and "logps/chosen" in whole
    for result in batched:
        for key, value in whole.items():
            assert result[key] == pytest.approx(value, abs=1e-5), key
    assert abs(whole["logps/chosen"] - first8["logps/chosen"]) > 1e-3  # the last 2 pairs matter


def _evaluate_layout(ckpt_dir, pp, vpp, reference_mode):
    """Eval metrics over 7 pairs with global batch 4, micro-batch 1: steps of 4 and 3 micro-
    batches (and one micro-batch per call in the precompute pass)."""
    pairs = random_pairs(
        EVAL_PAIRS + 4, seed=5, lengths=lambda i: (3 + i % 5, 2 + i % 4, 4 - i % 3)
    )
    trainer = tiny_trainer(
        pairs[:4],
        pairs[4:11],
        global_batch_size=4,
        micro_batch_size=1,
        steps=1,
        seed=3,
        pp=pp,
        vpp=vpp,
        load=ckpt_dir,
        reference_mode=reference_mode,
    )
    return _close_after(
        trainer, trainer.evaluator.run(trainer.policy, trainer.reference, trainer.loss_fn)
    )


REFERENCE_MODES = ["model", "precomputed"]


@pytest.mark.slow
@pytest.mark.parametrize("reference_mode", REFERENCE_MODES)
def test_interleaved_pipeline_evaluates_a_smaller_last_step(runs, reference_mode):
    """megatron-core's interleaved schedule refuses a forward-only call whose micro-batch count
    is not a multiple of PP (the last eval step's 3 micro-batches at PP 2; the precompute pass's
    single one): such calls are padded with copies whose outputs are dropped, and the eval
    metrics equal the one-stage run's."""
    vpp, one = runs[f"vpp_{reference_mode}"], runs[f"one_{reference_mode}"][0]
    assert len(vpp) == 2
    assert "logps/chosen" in one
    for metrics in vpp:
        for key, value in one.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
