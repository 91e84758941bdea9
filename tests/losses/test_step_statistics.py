"""beta-DPO's step statistic (batch beta, moving averages, margin filter) by hand, and its
wiring."""

import math

import pytest
import torch

from dpo_megatron.losses import LOSSES, build_loss
from dpo_megatron.losses.targets import StatisticShare
from tests.losses.pairs import pair_scores
from tests.losses.test_gradients_and_step_zero import token_batch

MARGINS = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)


def test_first_step_by_hand():
    loss_fn = build_loss({"name": "beta_dpo"})
    scalars, per_item = loss_fn.begin_step(MARGINS, torch.arange(5), training=True)
    state = loss_fn.components[0].state
    # M_0 = 0.1 * mean 2 = 0.2; sigma = 0.1 * unbiased std sqrt(2.5).
    assert state.margin_mean == pytest.approx(0.2, abs=1e-15)
    assert state.margin_std == pytest.approx(0.1 * math.sqrt(2.5), abs=1e-15)
    # K = floor(5 * 0.8) = 4. The weights exp(-(M - 0.2)^2 / (2 sigma^2)) are e^-6.4, e^-12.8, ...
    # for M = 0, 1, ...: the margin 4 has log-weight -289 against -64 or more: it is the one left
    # out.
    assert per_item["pair_weights"].tolist() == [1.25, 1.25, 1.25, 1.25, 0.0]
    # beta = 0.1 (1 + 0.6 (mean(0, 1, 2, 3) - 0.2)) = 0.178
    assert scalars["batch_beta"] == pytest.approx(0.178, abs=1e-15)


def test_moving_averages_over_steps_and_checkpoint_state():
    loss_fn = build_loss(
        {"name": "beta_dpo", "beta_dpo_momentum": 0.5, "beta_dpo_filter_ratio": 0.0}
    )
    loss_fn.begin_step(MARGINS, torch.arange(5), training=True)
    scalars, per_item = loss_fn.begin_step(MARGINS + 2.0, torch.arange(5), training=True)
    state = loss_fn.components[0].state
    assert state.margin_mean == pytest.approx(0.5 * 1.0 + 0.5 * 4.0)  # M_0 = 1 after step 1
    assert state.margin_std == pytest.approx(0.75 * math.sqrt(2.5))
    assert per_item["pair_weights"].tolist() == [1.0] * 5  # rho = 0 keeps every pair
    assert scalars["batch_beta"] == pytest.approx(0.1 * (1 + 0.6 * (4.0 - 2.5)))
    restored = build_loss(
        {"name": "beta_dpo", "beta_dpo_momentum": 0.5, "beta_dpo_filter_ratio": 0.0}
    )
    restored.load_state_dict(loss_fn.state_dict())
    assert (
        restored.state_dict()
        == loss_fn.state_dict()
        == {"beta_dpo": {"margin_mean": 2.5, "margin_std": state.margin_std, "steps": 2}}
    )


def test_evaluation_leaves_the_state_alone_and_uses_beta_0():
    loss_fn = build_loss({"name": "beta_dpo"})
    assert loss_fn.needs_step_statistic(True) and not loss_fn.needs_step_statistic(False)
    assert loss_fn.begin_step(MARGINS, torch.arange(5), training=False) == ({}, {})
    assert loss_fn.state_dict() == {"beta_dpo": {"margin_mean": 0.0, "margin_std": 0.0, "steps": 0}}
    assert not build_loss({"name": "sigmoid"}).needs_step_statistic(True)


def test_the_draw_depends_on_the_pairs_not_on_their_order():
    """Equal weights (step 0: every margin 0): the kept set is random, but the same whatever order
    (layout) the global batch was gathered in."""
    keys = torch.tensor([11, 3, 7, 0, 5, 9, 2, 4])
    kept = []
    for perm in (
        torch.arange(8),
        torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]),
        torch.tensor([3, 0, 6, 1, 4, 7, 2, 5]),
    ):
        loss_fn = build_loss({"name": "beta_dpo", "beta_dpo_filter_ratio": 0.5})
        scalars, per_item = loss_fn.begin_step(
            torch.zeros(8, dtype=torch.float64), keys[perm], training=True
        )
        assert scalars["batch_beta"] == 0.1  # every margin equals M_0 = 0
        kept.append(sorted(keys[perm][per_item["pair_weights"] > 0].tolist()))
        assert per_item["pair_weights"].sum().item() == 8.0  # N/K per kept pair: the mean over kept
    assert kept[0] == kept[1] == kept[2] and len(kept[0]) == 4
    # Successive steps draw afresh.
    loss_fn = build_loss({"name": "beta_dpo", "beta_dpo_filter_ratio": 0.5})
    draws = {
        tuple(
            loss_fn.begin_step(torch.zeros(8, dtype=torch.float64), keys, True)[1][
                "pair_weights"
            ].tolist()
        )
        for _ in range(6)
    }
    assert len(draws) > 1


def test_step_zero_mean_over_kept_pairs_is_ln2():
    token_logps, loss_mask = token_batch(pairs=3)
    loss_fn = build_loss({"name": "beta_dpo"})
    values = loss_fn.item_statistics(pair_scores(token_logps, token_logps.clone(), loss_mask))
    assert values.tolist() == [0.0, 0.0, 0.0]
    scalars, per_item = loss_fn.begin_step(values, torch.arange(3), training=True)
    share = StatisticShare(scalars, per_item)
    losses, metrics = loss_fn(
        pair_scores(token_logps, token_logps.clone(), loss_mask, statistic=share)
    )
    # K = floor(3 * 0.8) = 2 kept pairs at weight 3/2 each: the mean over all 3 is ln 2.
    assert sorted(losses.tolist()) == pytest.approx(
        [0.0, 1.5 * math.log(2.0), 1.5 * math.log(2.0)], abs=1e-15
    )
    assert losses.mean().item() == pytest.approx(math.log(2.0), abs=1e-15)
    assert (
        metrics["beta_dpo/kept"].sum().item() == 2.0
        and metrics["beta_dpo/beta"].tolist() == [0.1] * 3
    )


def test_pair_statistics_are_the_log_ratio_margins():
    token_logps, loss_mask = token_batch(pairs=3)
    reference = token_logps * 0.5
    loss_fn = build_loss({"name": "beta_dpo"})
    values = loss_fn.item_statistics(pair_scores(token_logps, reference, loss_mask))
    sums = (token_logps * loss_mask).sum(-1)
    expected = 0.5 * (sums[:3] - sums[3:])  # h_w - h_l with h = 0.5 * policy
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-12)


def test_state_parameters_are_config_keys_with_checked_ranges():
    assert LOSSES["beta_dpo"].params == {
        "beta": 0.1,
        "beta_dpo_alpha": 0.6,
        "beta_dpo_filter_ratio": 0.2,
        "beta_dpo_momentum": 0.9,
    }
    with pytest.raises(ValueError, match="beta_dpo_momentum"):
        build_loss({"name": "sigmoid", "beta_dpo_momentum": 0.5})
    with pytest.raises(ValueError, match="out of range"):
        build_loss({"name": "beta_dpo", "beta_dpo_filter_ratio": 1.0})
    state = build_loss({"name": "beta_dpo", "beta": 0.3, "beta_dpo_alpha": 1.0}).components[0].state
    assert (state.beta, state.alpha, state.filter_ratio, state.momentum) == (0.3, 1.0, 0.2, 0.9)
