"""KTO by hand: the loss, its KL reference point, TRL's metrics and the paper's weight check."""

import math

import pytest
import torch

from dpo_megatron.losses import build_loss
from dpo_megatron.losses.kto import finish_kto_metrics, weight_advice
from tests.losses.pairs import call_loss, pair_scores, unpaired_scores
from tests.losses.test_gradients_and_step_zero import token_batch


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_values_by_hand():
    # h = 2 (desirable) and -3 (undesirable), z_0 = 0.5, beta 0.1, lambda_D 1.5, lambda_U 0.75.
    losses, metrics = call_loss(
        "kto",
        [-10.0, -20.0],
        [-7.0, -9.0],
        [-12.0, -17.0],
        [-8.0, -8.0],
        [4, 5],
        [3, 3],
        desirable=torch.tensor([1.0, 0.0]),
        kl=0.5,
        desirable_weight=1.5,
        undesirable_weight=0.75,
    )
    assert losses.tolist() == pytest.approx(
        [1.5 * (1 - sigmoid(0.1 * (2 - 0.5))), 0.75 * (1 - sigmoid(0.1 * (0.5 + 3)))], abs=1e-15
    )
    assert metrics["rewards/chosen_sum"].tolist() == pytest.approx([0.2, 0.0])
    assert metrics["rewards/rejected_sum"].tolist() == pytest.approx([0.0, -0.3])
    assert metrics["kl"].tolist() == [0.5, 0.5]


def test_finish_metrics_takes_each_sides_mean_as_trl():
    means = {
        "loss": 0.4,
        "rewards/chosen_sum": 0.6 / 4,
        "rewards/rejected_sum": -0.3 / 4,
        "logps/chosen_sum": -30.0 / 4,
        "logps/rejected_sum": -10.0 / 4,
        "count/chosen": 3 / 4,
        "count/rejected": 1 / 4,
        "kl": 0.2,
    }
    out = finish_kto_metrics(means, 4)
    assert out == pytest.approx(
        {
            "loss": 0.4,
            "kl": 0.2,
            "count/chosen": 3.0,
            "count/rejected": 1.0,
            "rewards/chosen": 0.2,
            "rewards/rejected": -0.3,
            "rewards/margins": 0.5,
            "logps/chosen": -10.0,
            "logps/rejected": -10.0,
        }
    )
    only_desirable = finish_kto_metrics({**means, "count/chosen": 1.0, "count/rejected": 0.0}, 4)
    assert "rewards/rejected" not in only_desirable and "rewards/margins" not in only_desirable


def test_kl_reference_point_is_the_clamped_global_mean():
    loss_fn = build_loss({"name": "kto"})
    token_logps, loss_mask = token_batch(pairs=3)
    reference = token_logps * 0.5
    desirable = torch.tensor([1.0, 0.0, 1.0])
    values = loss_fn.item_statistics(unpaired_scores(token_logps, reference, loss_mask, desirable))
    sums = (token_logps * loss_mask).sum(-1)
    torch.testing.assert_close(values, 0.5 * sums[3:], rtol=0, atol=1e-12)  # the mismatched rows
    assert loss_fn.begin_step(values, torch.arange(3), True) == ({"kl": 0.0}, {})  # negative -> 0
    scalars, _ = loss_fn.begin_step(
        torch.tensor([0.5, 1.0, -0.3], dtype=torch.float64), torch.arange(3), True
    )
    assert scalars["kl"] == pytest.approx(0.4)
    assert loss_fn.state_dict() == {
        "kto": {"kl": pytest.approx(0.4)}
    }  # evaluation uses the last z_0
    losses, metrics = loss_fn(
        unpaired_scores(token_logps, token_logps.clone(), loss_mask, desirable)
    )
    assert metrics["kl"].tolist() == pytest.approx([0.4] * 3)
    assert losses.tolist() == pytest.approx(
        [1 - sigmoid(-0.04), 1 - sigmoid(0.04), 1 - sigmoid(-0.04)]
    )


def test_weight_advice_follows_the_paper_range():
    assert weight_advice(150, 150, 1.0, 1.0) == weight_advice(120, 100, 1.0, 1.0) is None
    advice = weight_advice(50, 150, 1.0, 1.0)
    assert "0.333" in advice and "[3, 4]" in advice and "[0.25, 0.333]" in advice
    assert weight_advice(10, 0, 1.0, 1.0) is None
    loss_fn = build_loss({"name": "kto", "desirable_weight": 3.0})
    assert (
        loss_fn.data_advice(
            [type("Item", (), {"desirable": d})() for d in (True, False, False, False)]
        )
        is None
    )


def test_training_examples_of_one_label_only_are_warned_about():
    """KTO data whose labels are all true (or all false) gets a start-up warning naming the
    count and the missing label, where the paper's weight check has no ratio to test; data with
    both labels gets none beyond that check."""
    loss_fn = build_loss({"name": "kto"})

    def items(*labels):
        return [type("Item", (), {"desirable": d})() for d in labels]

    assert loss_fn.data_advice(items(True, True, True, True)) == (
        "KTO: all 4 training examples are desirable (label true), none undesirable (label "
        "false): the loss of that side is never taken; check the data's label column"
    )
    assert loss_fn.data_advice(items(False, False)).startswith(
        "KTO: all 2 training examples are undesirable (label false), none desirable (label true)"
    )
    assert loss_fn.data_advice(items(True, False)) is None


def test_kto_cannot_be_combined_or_modified_and_needs_labels():
    with pytest.raises(ValueError, match="cannot be combined"):
        build_loss({"name": ["kto", "sigmoid"]})
    with pytest.raises(ValueError, match="sft_weight does not apply"):
        build_loss({"name": "kto", "sft_weight": 1.0})
    token_logps, loss_mask = token_batch(pairs=3)
    kto = build_loss({"name": "kto"})
    with pytest.raises(ValueError, match="trains on unpaired items, got pairs targets"):
        kto(pair_scores(token_logps, token_logps.clone(), loss_mask))
    with pytest.raises(ValueError, match="desirable labels must be"):
        kto(unpaired_scores(token_logps, token_logps.clone(), loss_mask, torch.ones(2)))
    assert kto.item_kind == "unpaired"
    assert (
        build_loss({"name": "sft"}).item_kind == "sft"
        and build_loss({"name": "ipo"}).item_kind == "pairs"
        and build_loss({"name": "bradley_terry"}).item_kind == "reward"
    )


def test_kto_reads_the_examples_in_its_pass_and_the_mismatched_ones_in_its_statistic():
    """The sides the engine computes for each pass (``BatchBuilder.computing``): KTO's loss
    reads the examples' own completions, its KL reference point the mismatched ones; a paired
    loss reads both, with or without a statistic."""
    kto = build_loss({"name": "kto"})
    assert kto.loss_sides == ("chosen",) and kto.statistic_sides == ("rejected",)
    assert kto.item_kind == "unpaired"
    dpo = build_loss({"name": "sigmoid"})
    assert dpo.loss_sides == ("chosen", "rejected") and dpo.statistic_sides is None
    beta_dpo = build_loss({"name": "beta_dpo"})
    assert beta_dpo.statistic_sides == beta_dpo.loss_sides == ("chosen", "rejected")
