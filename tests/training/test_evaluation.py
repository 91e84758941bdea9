"""Evaluation covers every eval pair, with a smaller last batch (issue 16).

Old behaviour (5fd70fa): the eval split was cut into whole global batches, so with 10 eval pairs
and ``train.global_batch_size=4`` the last 2 pairs were never evaluated and the reported means
were those of 8 pairs.
"""

import pytest

from dpo_megatron.training.evaluation import eval_micro_batch_indices
from tests.engine import random_pairs, tiny_trainer
from tests.multirank import run_ranks

EVAL_PAIRS = 10


def test_micro_batch_indices_cover_every_item_once():
    for num, gbs, mbs, dp in [(10, 4, 2, 1), (10, 4, 2, 2), (10, 4, 1, 2), (7, 4, 2, 2), (3, 8, 2, 2)]:
        seen = [i for rank in range(dp)
                for step in eval_micro_batch_indices(num, gbs, mbs, rank, dp)
                for micro in step for i in micro]
        assert sorted(seen) == list(range(num)), (num, gbs, mbs, dp)


def _evaluate(global_batch_size, micro_batch_size, num_eval=EVAL_PAIRS):
    """Forward-only eval metrics of the untrained tiny model over the first ``num_eval`` of the
    10 eval pairs."""
    pairs = random_pairs(EVAL_PAIRS + 4, seed=5, lengths=lambda i: (3 + i % 5, 2 + i % 4, 4 - i % 3))
    trainer = tiny_trainer(pairs[:4], pairs[4:4 + num_eval], global_batch_size=global_batch_size,
                           micro_batch_size=micro_batch_size, steps=1, seed=3)
    return trainer.evaluator.run(trainer.policy, trainer.reference, trainer.loss_fn)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_ten_eval_pairs_with_global_batch_four_are_all_evaluated(world_size):
    """Global batches 4 + 4 + 2 (on DP 2: shares 2, 2 and 1 per rank) give the same means as one
    batch of all 10, and differ from the mean of the first 8 pairs (what the old code reported)."""
    micro = 2 if world_size == 1 else 1
    batched = run_ranks(_evaluate, world_size=world_size, global_batch_size=4, micro_batch_size=micro)
    whole = run_ranks(_evaluate, world_size=1, global_batch_size=10, micro_batch_size=10)[0]
    first8 = run_ranks(_evaluate, world_size=1, global_batch_size=8, micro_batch_size=8, num_eval=8)[0]
    assert batched[0].keys() == whole.keys() and "logps/chosen" in whole
    for result in batched:
        for key, value in whole.items():
            assert result[key] == pytest.approx(value, abs=1e-5), key
    assert abs(whole["logps/chosen"] - first8["logps/chosen"]) > 1e-3  # the last 2 pairs matter



def _evaluate_layout(ckpt_dir, pp, vpp, reference_mode):
    """Eval metrics over 7 pairs with global batch 4, micro-batch 1: steps of 4 and 3 micro-
    batches (and one micro-batch per call in the precompute pass)."""
    pairs = random_pairs(EVAL_PAIRS + 4, seed=5, lengths=lambda i: (3 + i % 5, 2 + i % 4, 4 - i % 3))
    trainer = tiny_trainer(pairs[:4], pairs[4:11], global_batch_size=4,
                           micro_batch_size=1, steps=1, seed=3, pp=pp, vpp=vpp, load=ckpt_dir,
                           reference_mode=reference_mode)
    return trainer.evaluator.run(trainer.policy, trainer.reference, trainer.loss_fn)


@pytest.mark.slow
@pytest.mark.parametrize("reference_mode", ["model", "precomputed"])
def test_interleaved_pipeline_evaluates_a_smaller_last_step(initial_checkpoint, reference_mode):
    """Old: megatron-core's interleaved schedule refused a forward-only call whose micro-batch
    count is not a multiple of PP (the last eval step's 3 micro-batches at PP 2; the precompute
    pass's single one). Now such calls are padded with copies whose outputs are dropped, and the
    eval metrics equal the one-stage run's."""
    vpp = run_ranks(_evaluate_layout, world_size=2, ckpt_dir=initial_checkpoint, pp=2, vpp=2,
                    reference_mode=reference_mode)
    one = run_ranks(_evaluate_layout, world_size=1, ckpt_dir=initial_checkpoint, pp=1, vpp=None,
                    reference_mode=reference_mode)[0]
    assert "logps/chosen" in one
    for metrics in vpp:
        for key, value in one.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
