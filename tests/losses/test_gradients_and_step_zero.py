"""Gradients against finite differences, and the known step-0 values (policy == reference)."""

import math

import pytest
import torch

from dpo_megatron.losses import LOSSES, build_loss
from tests.losses.pairs import as_tensor, pair_scores, unpaired_scores

# Three pairs away from every kink (hinge's 1 - beta h = 0, ties in AOT's sorts).
PAIRS = dict(
    pc=[-12.0, -30.5, -7.25],
    pr=[-20.0, -28.0, -9.5],
    rc=[-13.0, -29.0, -8.0],
    rr=[-15.0, -27.5, -11.0],
    ct=[8, 20, 5],
    rt=[10, 16, 7],
)
EXTRA_PARAMS = {
    "bco_pair": {"reward_mean": 0.3},
    "cal_dpo": {"beta": 0.1},
    "kto": {"desirable": torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), "kl": 0.3},
    "beta_dpo": {
        "batch_beta": 0.17,
        "pair_weights": torch.tensor([1.5, 0.0, 1.5], dtype=torch.float64),
    },
    "robust": {"label_smoothing": 0.2},
    "sigmoid": {"label_smoothing": 0.1},
    "simpo": {"cpo_alpha": 0.5},
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradients_match_finite_differences(name):
    spec = LOSSES[name]
    inputs = tuple(
        as_tensor(PAIRS[k], torch.float64).requires_grad_() for k in ("pc", "pr", "rc", "rr")
    )
    chosen_tokens, rejected_tokens = (
        as_tensor(PAIRS["ct"], torch.float64),
        as_tensor(PAIRS["rt"], torch.float64),
    )

    def losses(pc, pr, rc, rr):
        return spec.fn(
            pc,
            pr,
            rc,
            rr,
            chosen_tokens=chosen_tokens,
            rejected_tokens=rejected_tokens,
            **EXTRA_PARAMS.get(name, {}),
        )[0]

    assert torch.autograd.gradcheck(losses, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


STEP_ZERO = {
    "sigmoid": math.log(2.0),
    "sigmoid_norm": math.log(2.0),
    "rpo": None,
    "robust": math.log(2.0),
    "hinge": 1.0,
    "ipo": 25.0,
    "exo_pair": -math.log(2.0) - 0.5 * (math.log(1e-3) + math.log(0.999)),
    "nca_pair": 2 * math.log(2.0),
    "bco_pair": 2 * math.log(2.0),
    "sppo_hard": 50.0,
    "aot": math.log(2.0),
    "aot_unpaired": math.log(2.0),
    "apo_zero": 1.0,
    "apo_down": 1.0,
    "discopop": 0.5 * (math.log(2.0) + 1.0),
    "kto": 0.5,
    "beta_dpo": math.log(2.0),
    "cal_dpo": math.log(2.0) + 1.0 / (4 * 1e-3**2),
}


def token_batch(pairs=3, seq=7, seed=0):
    """[2B, S] token log-probs and a mask with a 2-token prompt and completions of different
    lengths."""
    generator = torch.Generator().manual_seed(seed)
    token_logps = -torch.rand(2 * pairs, seq, generator=generator, dtype=torch.float64) * 3
    loss_mask = torch.zeros(2 * pairs, seq, dtype=torch.float64)
    for row, length in enumerate([5, 3, 4, 2, 5, 1][: 2 * pairs]):
        loss_mask[row, 2 : 2 + length] = 1.0
    return token_logps * loss_mask, loss_mask


def test_every_reference_based_loss_has_a_step_zero_value():
    assert sorted(STEP_ZERO) == sorted(
        name for name, spec in LOSSES.items() if spec.needs_reference
    )


@pytest.mark.parametrize("name", sorted(STEP_ZERO))
def test_step_zero_value_and_zero_rewards(name):
    token_logps, loss_mask = token_batch()
    loss_fn = build_loss({"name": name})
    if LOSSES[name].unpaired:
        desirable = torch.tensor([1.0, 0.0, 1.0])
        scores = unpaired_scores(token_logps, token_logps.clone(), loss_mask, desirable)
    else:
        scores = pair_scores(token_logps, token_logps.clone(), loss_mask)
    losses, metrics = loss_fn(scores)
    expected = STEP_ZERO[name]
    if name == "rpo":  # ln 2 + per-token NLL of each chosen completion (alpha 1)
        expected = math.log(2.0) - (token_logps[:3].sum(-1) / loss_mask[:3].sum(-1))
    torch.testing.assert_close(
        losses,
        torch.broadcast_to(torch.as_tensor(expected, dtype=torch.float64), (3,)),
        rtol=0,
        atol=1e-12,
    )
    if loss_fn.unpaired:  # KTO: per-side means over the step (finish_metrics), no accuracy
        means = loss_fn.finish_metrics({k: v.mean().item() for k, v in metrics.items()}, 3)
        assert [means[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")] == [
            0.0
        ] * 3
        return
    for metric in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[metric].tolist() == [0.0, 0.0, 0.0], metric
