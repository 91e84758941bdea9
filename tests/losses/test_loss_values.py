"""Loss values: the shared float64 cases file, and hand-derived cases for losses it does not
cover."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.losses.pairs import INPUT_NAMES, call_loss

# The project's shared folder sits beside the repository (``../shared``), in a clone anywhere as
# in CI; DPO_MEGATRON_SHARED points elsewhere.
SHARED = Path(
    os.environ.get("DPO_MEGATRON_SHARED", Path(__file__).resolve().parents[2].parent / "shared")
)
CASES_FILE = SHARED / "cases" / "loss_cases.json"
CASES = json.loads(CASES_FILE.read_text())["cases"] if CASES_FILE.exists() else []


def test_the_shared_cases_are_read_in_ci():
    """A clone without ``../shared`` skips the cases below; CI must not."""
    if os.environ.get("CI") == "true":
        assert len(CASES) >= 12, f"{CASES_FILE}: {len(CASES)} cases (CI must read them)"
    elif not CASES:
        pytest.skip(f"{CASES_FILE} not present (set DPO_MEGATRON_SHARED)")


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.skipif(not CASES, reason=f"{CASES_FILE} not present")
@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)], ids=["fp64", "fp32"]
)
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['loss_type']}" for i, c in enumerate(CASES)])
def test_cases_file(case, dtype, tolerance):
    params = {
        k: v for k, v in case.items() if k not in (*INPUT_NAMES, "loss_type", "expected_loss")
    }
    losses, metrics = call_loss(
        case["loss_type"], *(case[k] for k in INPUT_NAMES), dtype=dtype, **params
    )
    assert losses.shape == (1,)
    assert abs(losses.item() - case["expected_loss"]) <= tolerance * max(
        1.0, abs(case["expected_loss"])
    )
    assert metrics["logps/chosen"].item() == case["policy_chosen_logps"]


# The file's inputs: log-probs -12, -20 (policy) and -13, -15 (reference), 8 and 10 tokens, so the
# log-ratios are h_w = 1, h_l = -5, h = 6, and with beta = 0.1 the DPO margin is z = 0.6.
FILE_INPUTS = (-12.0, -20.0, -13.0, -15.0, 8, 10)
HAND_CASES = [
    # rDPO, eps = 0.1: [(1 - eps) softplus(-z) - eps softplus(z)] / (1 - 2 eps)
    (
        "robust",
        dict(beta=0.1, label_smoothing=0.1),
        (0.9 * softplus(-0.6) - 0.1 * softplus(0.6)) / 0.8,
    ),
    # EXO, eps = 1e-3: sigma(z)(log sigma(z) - log(1 - eps)) + sigma(-z)(log sigma(-z) - log eps)
    (
        "exo_pair",
        dict(beta=0.1),
        sigmoid(0.6) * (-softplus(-0.6) - math.log(0.999))
        + sigmoid(-0.6) * (-softplus(0.6) - math.log(1e-3)),
    ),
    # BCO, delta = 0.2: -log sigma(0.1 - 0.2) - log sigma(-(-0.5 - 0.2)) = softplus(0.1) +
    # softplus(-0.7)
    ("bco_pair", dict(beta=0.1, reward_mean=0.2), softplus(0.1) + softplus(-0.7)),
    # SPPO-hard: (h_w - 5)^2 + (h_l + 5)^2 = 16 + 0
    ("sppo_hard", dict(beta=0.1), 16.0),
    # APO-down: sigma(0.1 h_w) + 1 - sigma(z)
    ("apo_down", dict(beta=0.1), sigmoid(0.1) + 1.0 - sigmoid(0.6)),
    # length-normalised DPO: h_w / 8 - h_l / 10 = 0.125 + 0.5, beta 0.1 -> softplus(-0.0625)
    ("sigmoid_norm", dict(beta=0.1), softplus(-0.0625)),
    # IPO on sums: (6 - 5)^2
    ("ipo", dict(beta=0.1, average_logps=False), 1.0),
    # CPO-SimPO: SimPO margin 2 (-1.5 + 2) - 1 = 0 -> ln 2, plus 0.5 * NLL 12/8
    ("simpo", dict(beta=2.0, simpo_gamma=1.0, cpo_alpha=0.5), math.log(2.0) + 0.75),
    # SimPO on sums: 2 * 8 - 1 = 15
    ("simpo", dict(average_logps=False), softplus(-15.0)),
    # SFT: 12 / 8
    ("sft", dict(), 1.5),
    # Defaults: DPO beta 0.1 -> softplus(-0.6); SimPO beta 2, gamma 1 -> ln 2; ORPO lambda 0.1
    ("sigmoid", dict(), softplus(-0.6)),
    ("simpo", dict(), math.log(2.0)),
    (
        "discopop",
        dict(beta=0.1, discopop_tau=1.0),
        (1 - sigmoid(0.6)) * softplus(-0.6) + sigmoid(0.6) * math.exp(-0.6),
    ),
    # APO-zero with beta 0.2: 1 - sigma(0.2) + sigma(-1)
    ("apo_zero", dict(beta=0.2), 1.0 - sigmoid(0.2) + sigmoid(-1.0)),
    # Cal-DPO, beta 0.1 (targets +-5):
    # softplus(-h) + 1/2 [(h_w - 5)^2 + (h_l + 5)^2] = softplus(-6) + 8
    ("cal_dpo", dict(beta=0.1), softplus(-6.0) + 8.0),
    # beta-DPO with the step's beta 0.2 and a kept pair's weight N/K = 1.25: 1.25 softplus(-0.2 * 6)
    (
        "beta_dpo",
        dict(beta=0.1, batch_beta=0.2, pair_weights=torch.tensor([1.25])),
        1.25 * softplus(-1.2),
    ),
    # beta-DPO outside a training step (evaluation): plain DPO at beta_0
    ("beta_dpo", dict(beta=0.1), softplus(-0.6)),
    # a filtered pair counts 0
    ("beta_dpo", dict(beta=0.1, batch_beta=0.2, pair_weights=torch.tensor([0.0])), 0.0),
]


@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)], ids=["fp64", "fp32"]
)
@pytest.mark.parametrize(
    "name,params,expected", HAND_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HAND_CASES)]
)
def test_hand_derived(name, params, expected, dtype, tolerance):
    losses, _ = call_loss(name, *FILE_INPUTS, dtype=dtype, **params)
    assert abs(losses.item() - expected) <= tolerance * max(1.0, abs(expected))


def test_orpo_by_hand():
    # Averages -0.5 and -0.9: log odds = 0.4 - (log(1 - e^-0.5) - log(1 - e^-0.9)).
    log_odds = 0.4 - (math.log(1 - math.exp(-0.5)) - math.log(1 - math.exp(-0.9)))
    losses, metrics = call_loss("orpo", -4.0, -9.0, 0.0, 0.0, 8, 10)
    assert losses.item() == pytest.approx(0.5 + 0.1 * softplus(-log_odds), abs=1e-12)
    assert metrics["log_odds_chosen"].item() == pytest.approx(log_odds, abs=1e-12)
    assert metrics["log_odds_ratio"].item() == pytest.approx(-softplus(-log_odds), abs=1e-12)
    assert metrics["nll_loss"].item() == pytest.approx(0.5, abs=1e-15)
    assert metrics["rewards/chosen"].item() == pytest.approx(
        -0.05, abs=1e-15
    )  # beta * average log-prob
    assert metrics["logps/chosen"].item() == -4.0  # summed, nats


def test_aot_sorts_quantiles_within_the_batch():
    # Policy log-ratios log pi_w - log pi_l = [8, -1], reference ones = [-3, 2]:
    # sorted [-1, 8] - [-3, 2] = [2, 6] (pairwise DPO would see [11, -3]).
    losses, _ = call_loss(
        "aot", [-12.0, -10.0], [-20.0, -9.0], [-13.0, -10.0], [-10.0, -12.0], [8, 8], [9, 9]
    )
    torch.testing.assert_close(
        losses,
        torch.tensor([softplus(-0.2), softplus(-0.6)], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )


def test_aot_unpaired_sorts_chosen_and_rejected_separately():
    # h_w = [4, 1], h_l = [-5, 0]: sorted [1, 4] - [-5, 0] = [6, 4] (pairwise: [9, 1]).
    losses, _ = call_loss(
        "aot_unpaired",
        [-9.0, -12.0],
        [-20.0, -15.0],
        [-13.0, -13.0],
        [-15.0, -15.0],
        [8, 8],
        [9, 9],
    )
    torch.testing.assert_close(
        losses,
        torch.tensor([softplus(-0.6), softplus(-0.4)], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )


def test_metrics_of_a_reference_based_loss():
    # h_w = 1, h_l = -5; second pair h_w = -1, h_l = -1 (a tie is not accurate).
    _, metrics = call_loss(
        "sigmoid",
        [-12.0, -14.0],
        [-20.0, -16.0],
        [-13.0, -13.0],
        [-15.0, -15.0],
        [8, 8],
        [10, 10],
        beta=0.5,
    )
    expected = {
        "rewards/chosen": [0.5, -0.5],
        "rewards/rejected": [-2.5, -0.5],
        "rewards/accuracies": [1.0, 0.0],
        "rewards/margins": [3.0, 0.0],
        "logps/chosen": [-12.0, -14.0],
        "logps/rejected": [-20.0, -16.0],
    }
    assert sorted(metrics) == sorted(expected)
    for name, values in expected.items():
        assert metrics[name].tolist() == values, name
        assert not metrics[name].requires_grad


def test_rewards_of_reference_free_losses_are_beta_scaled_logps():
    _, simpo = call_loss("simpo", *FILE_INPUTS)  # beta 2 * averages -1.5, -2
    assert simpo["rewards/chosen"].item() == -3.0 and simpo["rewards/rejected"].item() == -4.0
    _, cpo = call_loss("cpo", *FILE_INPUTS)  # beta 0.1 * sums -12, -20
    assert cpo["rewards/chosen"].item() == pytest.approx(-1.2) and cpo["nll_loss"].item() == 1.5


@pytest.mark.parametrize("name", ["ipo", "sigmoid_norm"])
def test_length_normalised_losses_report_per_token_rewards(name):
    _, metrics = call_loss(name, *FILE_INPUTS)  # (-12 + 13) / 8 and (-20 + 15) / 10
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * 0.125)
    assert metrics["rewards/rejected"].item() == pytest.approx(0.1 * -0.5)
