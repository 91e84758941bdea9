"""beta-DPO and Cal-DPO train the same at every layout: its batch statistic covers the global batch.

Each layout runs the real trainer from one checkpoint over the same 8 pairs per step: two beta-DPO
steps (step 0: policy == reference, every margin 0; step 1: real margins, a moving average, a
filtered draw) and then one Cal-DPO step. Loss, metrics, grad norm and the set of kept pairs must
match the single-rank run with micro-batches of 2, at other micro-batch sizes, TP, PP and DP.
"""

import math

import pytest

from tests.engine import owns_results, step_record, tiny_trainer
from tests.multirank import run_ranks
from tests.training.test_dpo_step import GLOBAL_PAIRS, _pairs, _per_pair, _rel

pytestmark = pytest.mark.slow

LAYOUTS = [  # (TP, PP, micro_batch_size); DP = world / (TP * PP)
    (2, 2, 1, 4),
    (1, 2, 4, 4),
]


def _run(ckpt_dir, tp, pp, micro_batch_size):
    from megatron.core import parallel_state as ps

    from dpo_megatron.losses import build_loss

    trainer = tiny_trainer(_pairs(), tp=tp, pp=pp, load=ckpt_dir, micro_batch_size=micro_batch_size,
                           global_batch_size=GLOBAL_PAIRS, steps=3, lr=1e-2, seed=11,
                           loss={"name": "beta_dpo", "beta_dpo_filter_ratio": 0.25})
    history = [step_record(*trainer.train_step()) for _ in range(2)]
    state = trainer.loss_fn.state_dict()
    trainer.loss_fn = build_loss({"name": "cal_dpo", "beta": 0.1})
    history.append(step_record(*trainer.train_step()))
    return {"dp_rank": ps.get_data_parallel_rank(), "owner": owns_results(), "history": history,
            "state": state}


@pytest.fixture(scope="module")
def baseline(initial_checkpoint):
    return run_ranks(_run, world_size=1, ckpt_dir=initial_checkpoint, tp=1, pp=1, micro_batch_size=2)


def test_single_rank_step_zero_and_a_real_draw(baseline):
    steps = baseline[0]["history"]
    first = steps[0]["metrics"]
    assert abs(first["loss"] - math.log(2.0)) < 1e-6  # mean over the 6 kept pairs of ln 2
    assert first["beta_dpo/kept"] == 6 / 8 and first["beta_dpo/beta"] == pytest.approx(0.1, abs=1e-7)  # fp32 0.1
    second = steps[1]["metrics"]
    assert second["beta_dpo/beta"] != pytest.approx(0.1, abs=1e-6)  # the margins moved beta
    assert baseline[0]["state"]["beta_dpo"]["steps"] == 2
    assert steps[2]["metrics"]["cal_dpo/calibration"] > 0


@pytest.mark.parametrize("tp, pp, micro_batch_size, world", LAYOUTS)
def test_layout_matches_single_rank(initial_checkpoint, baseline, tp, pp, micro_batch_size, world):
    results = run_ranks(_run, world_size=world, ckpt_dir=initial_checkpoint, tp=tp, pp=pp,
                        micro_batch_size=micro_batch_size)
    for step in range(3):
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        assert set(got["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():
            assert abs(got["metrics"][key] - value) <= 1e-5 * max(abs(value), 1.0), (step, key)
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5, step
    for step in range(2):
        assert _per_pair(results, step, "beta_dpo/kept") == _per_pair(baseline, step, "beta_dpo/kept")
    assert all(r["state"] == results[0]["state"] for r in results)  # every rank's state alike
    state, want = results[0]["state"]["beta_dpo"], baseline[0]["state"]["beta_dpo"]
    assert abs(state["margin_mean"] - want["margin_mean"]) < 1e-5
