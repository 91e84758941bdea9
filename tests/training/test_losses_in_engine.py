"""Every registered loss runs through the pipeline engine, with the same value at every layout.

One TP 2 x PP 2 job and one single-rank job evaluate every loss (forward only) on the same
batch from the same weights; reference-based losses must give their known step-0 value.
"""

import os

import pytest

from dpo_megatron.losses import LOSSES
from dpo_megatron.losses.registry import get_loss_spec
from tests.engine import save_initial_checkpoint, tiny_pairs, tiny_trainer
from tests.losses.test_gradients_and_step_zero import STEP_ZERO
from tests.multirank import run_ranks
from tests.scripts import run_script

pytestmark = pytest.mark.slow

# Losses of a language model's log-probs; a reward model's loss (bradley_terry) needs its own head
# and runs through the engine at TP 2 x PP 2 against one rank in tests/models/test_reward_model.py.
LM_LOSSES = sorted(name for name in LOSSES if get_loss_spec(name).model_head == "lm")
CONFIGS = [{"name": name} for name in LM_LOSSES] + [
    {"name": "sigmoid", "label_smoothing": 0.2},
    {"name": "sigmoid", "use_weighting": True},
    {"name": "sigmoid", "ld_alpha": 0.5},
    {"name": "ipo", "sft_weight": 0.5},
    {"name": ["sigmoid", "sft"], "weights": [1.0, 0.5]},
    {"name": "simpo", "cpo_alpha": 1.0},
]


def _evaluate_all(ckpt_dir, tp, pp):
    from dpo_megatron.data.collate import PaddedPairs
    from dpo_megatron.data.pairs import UnpairedPair
    from dpo_megatron.losses import build_loss
    from dpo_megatron.training.step import step_forward_backward

    # The real trainer's policy and reference (loaded, resharded, DDP-wrapped); every loss then
    # evaluates the same device batch through the engine's step.
    trainer = tiny_trainer(tiny_pairs(8), tp=tp, pp=pp, load=ckpt_dir, seed=0)
    batch = PaddedPairs(0, 8 * tp).build(tiny_pairs(8), [[0, 1, 2, 3], [4, 5, 6, 7]])
    # Unpaired losses (kto): the same token ids as unpaired examples with alternating labels.
    unpaired = PaddedPairs(0, 8 * tp, "unpaired").build(
        [
            UnpairedPair(p.prompt_ids, p.chosen_ids, p.rejected_ids, desirable=i % 2 == 0)
            for i, p in enumerate(tiny_pairs(8))
        ],
        [[0, 1, 2, 3], [4, 5, 6, 7]],
    )
    out = {}
    for i, cfg in enumerate(CONFIGS):
        loss_fn = build_loss(cfg)
        if loss_fn.item_kind == "sft":  # chosen rows only
            continue
        result = step_forward_backward(
            trainer.policy,
            trainer.reference,
            (unpaired if loss_fn.unpaired else batch).to_device(),
            loss_fn,
            forward_only=True,
        )
        out[i] = result.metrics
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("losses") / "ckpt")
    run_ranks(save_initial_checkpoint, world_size=1, ckpt_dir=ckpt)
    single = run_ranks(_evaluate_all, world_size=1, ckpt_dir=ckpt, tp=1, pp=1)[0]
    split = run_ranks(_evaluate_all, world_size=4, ckpt_dir=ckpt, tp=2, pp=2)[0]
    return single, split


def test_every_loss_runs_in_the_engine_at_tp2_pp2_like_single_rank(results):
    single, split = results
    assert set(split) == set(single) and len(split) >= len(LM_LOSSES) + 4
    for i, metrics in split.items():
        for key, value in metrics.items():
            want = single[i][key]
            assert abs(value - want) <= 1e-5 * max(abs(want), 1.0), (CONFIGS[i], key)


def test_reference_based_losses_give_their_step_zero_value_in_the_engine(results):
    _, split = results
    for i, cfg in enumerate(CONFIGS):
        name = cfg["name"]
        if len(cfg) == 1 and name in STEP_ZERO and STEP_ZERO[name] is not None:
            # relative for cal_dpo's ln 2 + 250000 (fp32 spacing there is 1.6e-2)
            assert abs(split[i]["loss"] - STEP_ZERO[name]) < 1e-5 * max(1.0, STEP_ZERO[name]), name
            assert split[i]["rewards/margins"] == 0.0, name


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(tmp_path, *overrides):
    return run_script(
        "scripts/pretrain_dpo.sh",
        "--config",
        "configs/tiny_cpu.yaml",
        f"run_dir={tmp_path}",
        "train.train_iters=1",
        *overrides,
    )


def test_unknown_loss_or_parameter_fails_at_start_up_with_the_valid_ones(tmp_path):
    out = _launch(tmp_path, "loss.name=dpoo")
    assert out.returncode != 0 and "sigmoid" in out.stderr and "dpoo" in out.stderr
    out = _launch(tmp_path, "loss.name=sigmoid", "loss.gamma=1")
    assert out.returncode != 0 and "gamma" in out.stderr and "label_smoothing" in out.stderr
