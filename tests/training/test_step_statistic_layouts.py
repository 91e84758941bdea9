"""beta-DPO, Cal-DPO and KTO train the same at every layout: their batch statistics (beta-DPO's
batch beta and filter, KTO's KL reference point) cover the global batch.

Each layout runs the real trainer from one checkpoint over the same 8 items per step (unpaired
examples, 6 desirable, with the previous item's completion as the mismatched one, as the data path
makes them; the pair losses read them as pairs, their batch builder switched to the pairs kind's
targets): two KTO steps (step 0: policy == reference, KL 0;
step 1: a positive KL reference point), two beta-DPO steps (real margins, moving averages, a
filtered draw) and one Cal-DPO step. Loss, metrics, grad norm and the set of kept pairs must match
the single-rank run with micro-batches of 2, at other micro-batch sizes, TP, PP and DP.
"""

import pytest

from tests.engine import owns_results, step_record, tiny_pairs, tiny_trainer
from tests.multirank import run_ranks
from tests.training.test_dpo_step import GLOBAL_PAIRS, _per_pair, _rel

pytestmark = pytest.mark.slow

LAYOUTS = [  # (TP, PP, micro_batch_size); DP = world / (TP * PP)
    (2, 2, 1, 4),
    (1, 2, 4, 4),
]


def _items():
    from dpo_megatron.data.pairs import UnpairedExample
    from dpo_megatron.data.unpaired import with_kl_completions

    return with_kl_completions(
        [
            UnpairedExample(p.prompt_ids, p.chosen_ids, i % 4 != 0)
            for i, p in enumerate(tiny_pairs(GLOBAL_PAIRS))
        ],
        max_length=0,
    )


def _run(ckpt_dir, tp, pp, micro_batch_size, **config):
    from megatron.core import parallel_state as ps

    from dpo_megatron.losses import build_loss

    trainer = tiny_trainer(
        _items(),
        tp=tp,
        pp=pp,
        load=ckpt_dir,
        micro_batch_size=micro_batch_size,
        global_batch_size=GLOBAL_PAIRS,
        steps=5,
        lr=5e-3,
        seed=11,
        loss={"name": "kto", "beta": 0.5, "undesirable_weight": 1.5},
        **config,
    )

    def use_loss(config):  # a pair loss on the same items: the micro-batches carry pair targets
        trainer.loss_fn = build_loss(config)
        trainer.builder.kind = trainer.loss_fn.item_kind

    history = [step_record(*trainer.train_step()) for _ in range(2)]
    use_loss({"name": "beta_dpo", "beta_dpo_filter_ratio": 0.25})
    history += [step_record(*trainer.train_step()) for _ in range(2)]
    state = trainer.loss_fn.state_dict()
    use_loss({"name": "cal_dpo", "beta": 0.1})
    history.append(step_record(*trainer.train_step()))
    return {
        "dp_rank": ps.get_data_parallel_rank(),
        "owner": owns_results(),
        "history": history,
        "state": state,
    }


@pytest.fixture(scope="module")
def baseline(initial_checkpoint):
    return run_ranks(
        _run, world_size=1, ckpt_dir=initial_checkpoint, tp=1, pp=1, micro_batch_size=2
    )


def test_single_rank_known_values_and_live_statistics(baseline):
    steps = [s["metrics"] for s in baseline[0]["history"]]
    # KTO step 0: h = 0 and z_0 = 0: (6 lambda_D + 2 lambda_U) / 2 / 8 = (6 + 3) / 16.
    assert abs(steps[0]["loss"] - 9 / 16) < 1e-6 and steps[0]["kl"] == 0.0
    assert (steps[0]["count/chosen"], steps[0]["count/rejected"]) == (6.0, 2.0)
    assert steps[0]["rewards/margins"] == 0.0
    assert steps[1]["kl"] > 1e-3  # a live reference point at step 1
    assert steps[1]["rewards/margins"] > 0
    assert steps[2]["beta_dpo/kept"] == 6 / 8
    assert steps[3]["beta_dpo/beta"] != pytest.approx(0.1, abs=1e-4)  # the margins moved beta
    assert baseline[0]["state"]["beta_dpo"]["steps"] == 2
    assert steps[4]["cal_dpo/calibration"] > 0


@pytest.mark.parametrize("tp, pp, micro_batch_size, world", LAYOUTS)
def test_layout_matches_single_rank(initial_checkpoint, baseline, tp, pp, micro_batch_size, world):
    results = run_ranks(
        _run,
        world_size=world,
        ckpt_dir=initial_checkpoint,
        tp=tp,
        pp=pp,
        micro_batch_size=micro_batch_size,
    )
    for step in range(5):
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        assert set(got["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():
            assert abs(got["metrics"][key] - value) <= 1e-5 * max(abs(value), 1.0), (step, key)
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5, step
    for step in (2, 3):
        assert _per_pair(results, step, "beta_dpo/kept") == _per_pair(
            baseline, step, "beta_dpo/kept"
        )
    assert all(r["state"] == results[0]["state"] for r in results)  # every rank's state alike
    state, want = results[0]["state"]["beta_dpo"], baseline[0]["state"]["beta_dpo"]
    assert abs(state["margin_mean"] - want["margin_mean"]) < 1e-5


def test_packed_rows_and_precomputed_reference_carry_unpaired_examples(
    initial_checkpoint, baseline, tmp_path
):
    """The same five steps with packed rows and reference log-probs computed before training."""
    results = run_ranks(
        _run,
        world_size=1,
        ckpt_dir=initial_checkpoint,
        tp=1,
        pp=1,
        micro_batch_size=2,
        packing=True,
        reference_mode="precomputed",
        cache_dir=str(tmp_path),
    )
    for step in range(5):
        got, want = results[0]["history"][step], baseline[0]["history"][step]
        for key, value in want["metrics"].items():
            assert abs(got["metrics"][key] - value) <= 1e-5 * max(abs(value), 1.0), (step, key)
        assert _rel(got["grad_norm"], want["grad_norm"]) < 1e-5, step
