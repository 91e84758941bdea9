"""build_loss: config validation, the per-token interface, modifiers, combined losses, BCO state."""

import math

import pytest
import torch

from dpo_megatron.losses import LOSSES, build_loss
from tests.losses.pairs import pair_scores, sft_scores

F64 = torch.float64


def one_pair(chosen, rejected, prompt=1):
    """[2, S] token log-probs and mask of one pair: `prompt` masked positions, then the
    completion."""
    seq = prompt + max(len(chosen), len(rejected)) + 1
    token_logps = torch.zeros(2, seq, dtype=F64)
    loss_mask = torch.zeros(2, seq, dtype=F64)
    for row, values in enumerate((chosen, rejected)):
        token_logps[row, prompt : prompt + len(values)] = torch.tensor(values, dtype=F64)
        loss_mask[row, prompt : prompt + len(values)] = 1.0
    return token_logps, loss_mask


# Policy: chosen tokens sum to -6 over 3 tokens, rejected -10 over 4; reference: -7 and -8.
POLICY, MASK = one_pair([-1.0, -2.0, -3.0], [-4.0, -3.0, -2.0, -1.0])
REFERENCE, _ = one_pair([-2.0, -2.0, -3.0], [-2.0, -2.0, -2.0, -2.0])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown loss.name 'dpoo'") as error:
        build_loss({"name": "dpoo"})
    for name in LOSSES:
        assert repr(name) in str(error.value)
    assert "aliases: dpo (= sigmoid)" in str(error.value)


def test_dpo_is_an_alias_of_sigmoid():
    """``loss.name=dpo`` is known: it is Rafailov et al.'s sigmoid loss, under its usual name."""
    assert repr(build_loss({"name": "dpo"})) == repr(build_loss({"name": "sigmoid"}))


def test_parameter_the_loss_does_not_take_lists_valid_keys():
    """The error names the loss as the config does (``loss.name=sigmoid``, a list only for a
    combination) and lists the keys it takes."""
    with pytest.raises(
        ValueError, match=r"^loss.name=sigmoid takes no parameter\(s\) \['simpo_gamma'\]"
    ) as error:
        build_loss({"name": "sigmoid", "beta": 0.1, "simpo_gamma": 0.5})
    assert (
        "Valid keys: ['beta', 'label_smoothing', 'ld_alpha', 'name', 'reference_free', "
        "'sft_weight', "
        "'use_weighting', 'weights']" in str(error.value)
    )
    with pytest.raises(ValueError, match=r"^loss.name=\['sigmoid', 'sft'\] takes no parameter"):
        build_loss({"name": ["sigmoid", "sft"], "simpo_gamma": 0.5})


def test_a_misspelt_or_misplaced_parameter_is_named_with_its_fix():
    """A typo gets the nearest key the loss takes; another loss's parameter (SimPO's gamma given
    to sigmoid, label smoothing to IPO) names the losses that take it."""
    with pytest.raises(ValueError, match=r"\['betta'\]\. Did you mean loss\.beta for betta\?"):
        build_loss({"name": "sigmoid", "betta": 0.1})
    with pytest.raises(
        ValueError, match=r"simpo_gamma is a parameter of loss simpo, not of sigmoid\."
    ):
        build_loss({"name": "sigmoid", "simpo_gamma": 0.5})
    with pytest.raises(
        ValueError, match=r"label_smoothing is a parameter of loss aot, .*not of ipo"
    ):
        build_loss({"name": "ipo", "label_smoothing": 0.1})


def test_reference_free_is_not_a_key_of_reference_free_losses():
    with pytest.raises(ValueError, match="reference_free"):
        build_loss({"name": "simpo", "reference_free": True})


@pytest.mark.parametrize(
    "config,message",
    [
        ({}, "loss.name is required"),
        ({"name": []}, "lists no loss"),
        ({"name": ["sigmoid", "sigmoid"]}, "twice"),
        ({"name": "sigmoid", "beta": 0.0}, r"loss.beta=0.0 is out of range \(0.0, inf\]"),
        ({"name": "sigmoid", "beta": "0.1"}, "must be a number"),
        ({"name": "ipo", "average_logps": 1}, "must be true or false"),
        ({"name": "robust", "label_smoothing": 0.5}, "out of range"),
        ({"name": "exo_pair", "label_smoothing": 0.0}, "out of range"),
        ({"name": "sigmoid", "ld_alpha": 1.5}, "out of range"),
        ({"name": ["sigmoid", "sft"], "weights": [1.0]}, "1 entries for 2 losses"),
        ({"name": ["sigmoid", "aot"], "use_weighting": True}, r"cannot be combined with \['aot'\]"),
    ],
)
def test_invalid_configs_fail_at_construction(config, message):
    with pytest.raises(ValueError, match=message):
        build_loss(config)


def test_none_values_count_as_unset():
    loss_fn = build_loss({"name": "simpo", "beta": None, "ld_alpha": None})
    assert loss_fn.components[0].params["beta"] == 2.0 and loss_fn.modifiers.ld_alpha is None


def test_needs_reference_flags():
    assert build_loss({"name": "sigmoid"}).needs_reference
    for config in (
        {"name": "simpo"},
        {"name": "cpo"},
        {"name": "orpo"},
        {"name": "sft"},
        {"name": "sigmoid", "reference_free": True},
    ):
        assert not build_loss(config).needs_reference, config
    assert build_loss({"name": ["simpo", "sigmoid"]}).needs_reference
    assert not build_loss({"name": "sigmoid"}).needs_token_log_sum_p2
    assert build_loss({"name": "sigmoid", "use_weighting": True}).needs_token_log_sum_p2


def test_sigmoid_from_token_logps():
    losses, metrics = build_loss({"name": "sigmoid", "beta": 0.1})(
        pair_scores(POLICY, REFERENCE, MASK)
    )
    # h_w = -6 + 7 = 1, h_l = -10 + 8 = -2 -> z = 0.3
    torch.testing.assert_close(
        losses, torch.tensor([softplus(-0.3)], dtype=F64), rtol=0, atol=1e-12
    )
    assert metrics["logps/chosen"].tolist() == [-6.0] and metrics["logps/rejected"].tolist() == [
        -10.0
    ]
    assert metrics["rewards/margins"].item() == pytest.approx(0.3)


def test_reference_free_uses_no_reference():
    loss_fn = build_loss({"name": "sigmoid", "reference_free": True})
    losses, metrics = loss_fn(pair_scores(POLICY, None, MASK))
    torch.testing.assert_close(
        losses, torch.tensor([softplus(-0.4)], dtype=F64), rtol=0, atol=1e-12
    )  # 0.1*(-6+10)
    assert metrics["rewards/chosen"].item() == pytest.approx(-0.6)
    with pytest.raises(ValueError, match="uses no reference model"):
        loss_fn(pair_scores(POLICY, REFERENCE, MASK))


def test_missing_reference_is_an_error():
    with pytest.raises(ValueError, match="needs the reference log-probs"):
        build_loss({"name": "sigmoid"})(pair_scores(POLICY, None, MASK))


def test_sft_loss_on_pairs_and_on_sft_examples():
    loss_fn = build_loss({"name": "sft"})
    assert not loss_fn.needs_rejected
    losses, metrics = loss_fn(pair_scores(POLICY, None, MASK))
    assert losses.tolist() == [2.0] and metrics["nll_loss"].tolist() == [2.0]  # 6 / 3
    losses, _ = loss_fn(sft_scores(POLICY, MASK))  # both rows as SFT examples
    assert losses.tolist() == [2.0, 2.5]
    with pytest.raises(ValueError, match="trains on pairs items, got sft targets"):
        build_loss({"name": "sigmoid"})(sft_scores(POLICY, MASK))


def test_sft_weight_adds_chosen_nll():
    losses, metrics = build_loss({"name": "sigmoid", "sft_weight": 0.5})(
        pair_scores(POLICY, REFERENCE, MASK)
    )
    assert losses.item() == pytest.approx(softplus(-0.3) + 0.5 * 2.0, abs=1e-12)
    assert metrics["nll_loss"].tolist() == [2.0]


def test_combined_losses_with_weights():
    loss_fn = build_loss(
        {"name": ["sigmoid", "bco_pair", "sft"], "weights": [0.8, 0.2, 1.0], "beta": 0.1}
    )
    losses, metrics = loss_fn(pair_scores(POLICY, REFERENCE, MASK))
    sigmoid, bco = softplus(-0.3), softplus(-0.1) + softplus(-0.2)  # BCO: -log s(0.1) - log s(0.2)
    assert losses.item() == pytest.approx(0.8 * sigmoid + 0.2 * bco + 2.0, abs=1e-12)
    assert metrics["loss/sigmoid"].item() == pytest.approx(sigmoid, abs=1e-12)
    assert metrics["loss/bco_pair"].item() == pytest.approx(bco, abs=1e-12)
    assert metrics["loss/sft"].item() == 2.0
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1)


def test_per_loss_defaults_in_a_combination():
    loss_fn = build_loss({"name": ["simpo", "sigmoid"]})
    assert [c.params["beta"] for c in loss_fn.components] == [2.0, 0.1]


def test_ld_alpha_weights_tokens_past_the_shared_length():
    # Shared length min(3, 4) = 3: the rejected 4th token counts with weight 0.5, in the policy
    # (-1 -> -9.5) and in the reference (-2 -> -7): h_l = -2.5, h = 1 + 2.5.
    losses, metrics = build_loss({"name": "sigmoid", "ld_alpha": 0.5})(
        pair_scores(POLICY, REFERENCE, MASK)
    )
    assert metrics["logps/rejected"].tolist() == [-9.5]
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.25)
    assert losses.item() == pytest.approx(softplus(-0.35), abs=1e-12)


def test_ld_alpha_keeps_the_step_zero_value():
    losses, metrics = build_loss({"name": "sigmoid", "ld_alpha": 0.2})(
        pair_scores(POLICY, POLICY.clone(), MASK)
    )
    assert losses.item() == pytest.approx(math.log(2.0), abs=1e-15)
    assert metrics["rewards/margins"].tolist() == [0.0]


def test_wpo_weights_scale_the_pair_loss():
    # log sum_v p_v^2 = -0.5 at every position: w = exp(mean(logp) + 0.5) per sequence.
    log_sum_p2 = torch.full_like(POLICY, -0.5)
    loss_fn = build_loss({"name": "sigmoid", "use_weighting": True})
    losses, metrics = loss_fn(pair_scores(POLICY, REFERENCE, MASK, log_sum_p2))
    weight = math.exp((-2.0 + 0.5) + (-2.5 + 0.5))
    assert metrics["wpo/weights"].item() == pytest.approx(weight, rel=1e-12)
    assert losses.item() == pytest.approx(weight * softplus(-0.3), rel=1e-12)
    with pytest.raises(ValueError, match="needs the policy's log_sum_p2"):
        loss_fn(pair_scores(POLICY, REFERENCE, MASK))


def test_wpo_weight_is_capped_at_one():
    losses, metrics = build_loss({"name": "sigmoid", "use_weighting": True})(
        pair_scores(POLICY, REFERENCE, MASK, torch.full_like(POLICY, -10.0))
    )
    assert metrics["wpo/weights"].tolist() == [1.0]


def test_bco_running_mean_and_checkpoint_state():
    loss_fn = build_loss({"name": "bco_pair"})
    assert loss_fn.state_dict() == {"bco_pair": {"mean": 0.0, "count": 0}}
    _, metrics = loss_fn(pair_scores(POLICY, REFERENCE, MASK))
    assert metrics["bco/reward_mean"].item() == pytest.approx(-0.05)  # (0.1 - 0.2) / 2
    loss_fn.on_step_end({"bco/reward_mean": 0.4})
    loss_fn.on_step_end({"bco/reward_mean": 0.2})
    assert loss_fn.state_dict() == {"bco_pair": {"mean": pytest.approx(0.3), "count": 2}}
    losses, metrics = loss_fn(pair_scores(POLICY, REFERENCE, MASK))
    assert metrics["bco/delta"].item() == pytest.approx(0.3)
    assert losses.item() == pytest.approx(softplus(-(0.1 - 0.3)) + softplus(-0.2 - 0.3), abs=1e-12)

    restored = build_loss({"name": "bco_pair"})
    restored.load_state_dict(loss_fn.state_dict())
    assert restored.state_dict() == loss_fn.state_dict()
    with pytest.raises(ValueError, match="loss state in checkpoint"):
        restored.load_state_dict({})


def test_stateless_losses_have_empty_state():
    loss_fn = build_loss({"name": "sigmoid"})
    loss_fn.on_step_end({"rewards/chosen": 1.0})
    assert loss_fn.state_dict() == {}
    loss_fn.load_state_dict({})


def test_gradient_flows_to_policy_token_logps_only_through_the_mask():
    policy = POLICY.clone().requires_grad_()
    losses, _ = build_loss({"name": "sigmoid"})(pair_scores(policy, REFERENCE, MASK))
    losses.sum().backward()
    assert torch.all(policy.grad[MASK == 0] == 0)
    d = 0.1 * torch.sigmoid(
        torch.tensor(-0.3, dtype=F64)
    )  # d(-log s(z))/dz = -s(-z); dz/dlogp_w = beta
    torch.testing.assert_close(policy.grad[0, 1:4], -d.expand(3), rtol=0, atol=1e-12)


def test_batch_shapes_and_float32():
    generator = torch.Generator().manual_seed(0)
    policy = -torch.rand(8, 6, generator=generator)
    mask = torch.ones(8, 6)
    losses, metrics = build_loss({"name": "ipo"})(pair_scores(policy, policy - 0.1, mask))
    assert losses.shape == (4,) and losses.dtype == torch.float32
    assert all(value.shape == (4,) for value in metrics.values())
    with pytest.raises(ValueError, match="2B rows"):
        build_loss({"name": "sigmoid"})(pair_scores(policy[:3], policy[:3], mask[:3]))


@pytest.mark.parametrize(
    "config",
    [
        {"name": "sigmoid", "ld_alpha": 0.3, "sft_weight": 0.2},
        {"name": ["ipo", "simpo"], "weights": [0.5, 1.0], "reference_free": True},
        {"name": "orpo"},
    ],
)
def test_gradients_through_token_logps_match_finite_differences(config):
    loss_fn = build_loss(config)
    reference = REFERENCE if loss_fn.needs_reference else None

    def total(policy):
        return loss_fn(pair_scores(policy * MASK, reference, MASK))[0]

    assert torch.autograd.gradcheck(total, (POLICY.clone().requires_grad_(),), eps=1e-6, atol=1e-7)


def test_reference_free_combination_passes_zero_reference_to_reference_based_losses():
    losses, metrics = build_loss({"name": ["sigmoid", "cpo"], "reference_free": True})(
        pair_scores(POLICY, None, MASK)
    )
    # Both see the policy margin -6 + 10 = 4 at beta 0.1; CPO adds its NLL 6 / 3.
    assert metrics["loss/sigmoid"].item() == pytest.approx(softplus(-0.4), abs=1e-12)
    assert losses.item() == pytest.approx(2 * softplus(-0.4) + 2.0, abs=1e-12)


def test_describe_is_one_readable_line_with_every_parameter():
    """The start-up line's loss: names, parameters with their defaults, weights when several,
    the modifiers that are on; one readable line, not a dataclass repr."""
    assert build_loss({"name": "sigmoid"}).describe() == "loss sigmoid(beta=0.1, label_smoothing=0)"
    assert (
        build_loss(
            {"name": ["sigmoid", "sft"], "weights": [1.0, 0.5], "beta": 0.2, "ld_alpha": 0.5}
        ).describe()
        == "loss 1 x sigmoid(beta=0.2, label_smoothing=0) + 0.5 x sft() | LD-DPO (ld_alpha=0.5)"
    )


def test_a_loss_declares_its_parameter_ranges_and_batch_sorting_where_it_is_registered():
    """The ranges a loss's own parameters must lie in, and whether it sorts its micro-batch, sit
    at its @register_loss; shared keys take the common range unless the loss overrides it; a
    range for a key the loss does not take is refused when the loss is registered."""
    from dpo_megatron.losses import LOSSES
    from dpo_megatron.losses.registry import ParamRange, register_loss

    assert str(LOSSES["exo_pair"].param_ranges["label_smoothing"]) == "(0.0, 1.0)"
    assert str(LOSSES["sigmoid"].param_ranges["label_smoothing"]) == "[0.0, 0.5)"
    assert str(LOSSES["kto"].param_ranges["desirable_weight"]) == "(0.0, inf]"
    assert sorted(n for n, spec in LOSSES.items() if spec.sorts_batch) == ["aot", "aot_unpaired"]

    def stray_loss(policy_chosen_logps, policy_rejected_logps, *, beta: float = 0.1):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"a range for \['gamma'\], which it does not take"):
        register_loss("stray_range", needs_reference=False, ranges={"gamma": ParamRange(0.0)})(
            stray_loss
        )
    assert "stray_range" not in LOSSES
