"""The Bradley-Terry reward-model loss (``loss.name=bradley_terry``) against hand-computed
values."""

from __future__ import annotations

import math

import pytest
import torch

from dpo_megatron.losses import build_loss
from tests.losses.pairs import pair_scores, reward_scores


def test_equal_rewards_give_ln2_and_no_accuracy():
    loss_fn = build_loss({"name": "bradley_terry"})
    assert loss_fn.model_head == "reward" and not loss_fn.needs_reference
    rewards = torch.tensor([0.3, -1.0, 0.3, -1.0])  # chosen [0.3, -1], rejected the same
    losses, metrics = loss_fn(reward_scores(rewards))
    assert losses.tolist() == pytest.approx([math.log(2.0)] * 2, abs=1e-7)
    assert metrics["rewards/accuracies"].tolist() == [0.0, 0.0]  # a tie is not a win
    assert metrics["rewards/margins"].tolist() == [0.0, 0.0]


def test_values_margin_and_accuracy_by_hand():
    loss_fn = build_loss({"name": "bradley_terry"})
    chosen, rejected = [2.0, -0.5, 1.0], [0.5, 0.5, 1.5]
    losses, metrics = loss_fn(reward_scores(torch.tensor(chosen + rejected)))
    # -log sigmoid(z) = log(1 + exp(-z)) for z = 1.5, -1, -0.5
    assert losses.tolist() == pytest.approx(
        [math.log1p(math.exp(-1.5)), math.log1p(math.exp(1.0)), math.log1p(math.exp(0.5))],
        rel=1e-6,
    )
    assert metrics["rewards/accuracies"].tolist() == [1.0, 0.0, 0.0]
    assert metrics["rewards/margins"].tolist() == pytest.approx([1.5, -1.0, -0.5])
    assert metrics["rewards/chosen"].tolist() == chosen
    assert metrics["rewards/rejected"].tolist() == rejected
    # A per-pair margin m: -log sigmoid(r_c - r_r - m); m = 1.5 turns pair 0 into a tie.
    margined, _ = loss_fn(
        reward_scores(torch.tensor(chosen + rejected), margin=torch.tensor([1.5, 0.0, 0.0]))
    )
    assert margined[0].item() == pytest.approx(math.log(2.0))
    assert margined[1:].tolist() == pytest.approx(losses[1:].tolist())


def test_centring_term_by_hand():
    loss_fn = build_loss({"name": "bradley_terry", "center_rewards_coefficient": 0.01})
    losses, _ = loss_fn(reward_scores(torch.tensor([1.0, 3.0, 1.0, -2.0])))
    # pair 0: z = 0 -> ln 2 + 0.01 * (1 + 1)^2; pair 1: z = 5 -> log(1 + e^-5) + 0.01 * 1^2
    assert losses.tolist() == pytest.approx(
        [math.log(2.0) + 0.04, math.log1p(math.exp(-5.0)) + 0.01], rel=1e-6
    )


def test_refusals():
    with pytest.raises(ValueError, match="reward model"):
        build_loss({"name": ["bradley_terry", "sigmoid"]})
    with pytest.raises(ValueError, match="reward model"):
        build_loss({"name": "bradley_terry", "sft_weight": 1.0})
    with pytest.raises(ValueError, match="out of range"):
        build_loss({"name": "bradley_terry", "center_rewards_coefficient": -1.0})
    with pytest.raises(ValueError, match="trains on reward items, got pairs targets"):
        build_loss({"name": "bradley_terry"})(
            pair_scores(torch.zeros(2, 3), None, torch.ones(2, 3))
        )
    with pytest.raises(ValueError, match="trains on pairs items, got reward targets"):
        build_loss({"name": "sigmoid"})(reward_scores(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"rewards must be \[2B\]"):
        build_loss({"name": "bradley_terry"})(reward_scores(torch.zeros(3)))


def test_a_reward_head_learning_rate_needs_a_reward_model():
    from dpo_megatron.config import config_from_mapping

    def config(loss: str, **train):
        return config_from_mapping(
            {
                "data": {"path": "pairs.jsonl", "tokenizer": "tok"},
                "loss": {"name": loss},
                "train": train,
            }
        )

    assert config("bradley_terry", reward_head_lr=1e-3).train.reward_head_lr == 1e-3
    with pytest.raises(ValueError, match=r"train.reward_head_lr=0.001 .* loss.name=sigmoid trains"):
        config("sigmoid", reward_head_lr=1e-3)
    with pytest.raises(ValueError, match="train.reward_head_lr"):
        config("bradley_terry", reward_head_lr=1e-6, min_lr=1e-5, lr=1e-3)
