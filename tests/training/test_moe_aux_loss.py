"""The routers' load-balancing loss against transformers, and its gradient on the router.

A one-layer Qwen3-MoE and a one-layer gpt-oss (biased router logits; transformers'
``load_balancing_loss_func`` concatenates the layers before averaging; for one layer it is the
per-layer loss this engine averages) and a step of 4 pairs in two micro-batches, through the
real Trainer's policy and reference:

- the reported ``moe/load_balancing_loss`` is the mean over the micro-batches of transformers'
  loss on each micro-batch's padded rows (padding excluded by the attention mask), and
  ``moe/aux_loss`` is the coefficient times it;
- the preference loss is exactly ln 2 whatever the coefficient (policy == reference, and the
  auxiliary term stays out of it);
- the router's gradient with coefficient c minus its gradient with 0 is c times transformers'
  autograd gradient of that mean: the term reaches the router, at the weight the objective
  states, after megatron-core's division by the step's pair count.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine import random_pairs, tiny_trainer
from tests.models.conversion_helpers import build_tiny_hf_model, save_tiny_hf_folder
from tests.multirank import run_cases

COEFF = 0.25
PAIRS = 4
MICRO_BATCH = 2


def _router_gradients(hf_dir):
    """One forward-backward of the same step with coefficient COEFF and 0: ([(tokens [R, L],
    padding mask [R, L]) per micro-batch], reported metrics at COEFF and 0, preference losses,
    router gradient difference)."""
    from dpo_megatron.training.step import padding_mask, step_forward_backward

    pairs = random_pairs(PAIRS, seed=3, lengths=lambda i: (4 + i, 3 + i % 2, 6 - i), vocab=128)
    runs = []
    for coeff in (COEFF, 0.0):
        trainer = tiny_trainer(
            pairs,
            micro_batch_size=MICRO_BATCH,
            global_batch_size=PAIRS,
            model={
                "hf_path": hf_dir,
                "params_dtype": "float32",
                "transformer_impl": "local",
                "moe_aux_loss_coeff": coeff,
            },
        )
        batch = trainer.next_batch()
        for chunk in trainer.policy:
            chunk.zero_grad_buffer()
        out = step_forward_backward(trainer.policy, trainer.reference, batch, trainer.loss_fn)
        router = trainer.policy[0].module.decoder.layers[0].mlp.router.weight
        runs.append((out.metrics["loss"], out.aux_metrics, router.main_grad.clone()))
    (loss_c, aux_c, grad_c), (loss_0, aux_0, grad_0) = runs
    rows = [(micro.tokens, padding_mask(micro)) for micro in batch.micro_batches]
    return rows, aux_c, aux_0, (loss_c, loss_0), grad_c - grad_0


ROUTERS = {"qwen3_moe": "gate", "gpt_oss": "router"}
"""Each architecture's HF router module (gpt-oss's has a bias: its logits, and so the loss,
include it)."""


@pytest.fixture(scope="module")
def router_runs(tmp_path_factory):
    """``{arch: _router_gradients(...)}`` for every architecture of ROUTERS, one-layer folders,
    in one world of one rank."""
    root = tmp_path_factory.mktemp("moe_aux_loss")
    cases = {
        arch: (
            _router_gradients,
            dict(hf_dir=save_tiny_hf_folder(arch, str(root / arch), num_hidden_layers=1)),
        )
        for arch in sorted(ROUTERS)
    }
    return {name: per_rank[0] for name, per_rank in run_cases(1, cases).items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ROUTERS))
def test_load_balancing_loss_and_router_gradient_match_transformers(router_runs, arch):
    import importlib

    load_balancing_loss_func = importlib.import_module(
        f"transformers.models.{arch}.modeling_{arch}"
    ).load_balancing_loss_func
    rows, aux, aux_off, losses, router_grad = router_runs[arch]
    assert len(rows) == PAIRS // MICRO_BATCH
    assert all(padding.any() for _, padding in rows)  # padded rows: the mask matters
    assert all(abs(loss - math.log(2)) < 1e-6 for loss in losses)
    assert aux_off == {}  # coefficient 0: no term, nothing reported

    model = build_tiny_hf_model(arch, num_hidden_layers=1)
    config = model.config
    per_micro_batch = []
    for tokens, padding in rows:
        mask = (~padding).long()
        out = model(input_ids=tokens, attention_mask=mask, output_router_logits=True)
        per_micro_batch.append(
            load_balancing_loss_func(
                out.router_logits, config.num_experts, config.num_experts_per_tok, mask
            )
        )
    want = torch.stack(per_micro_batch).mean()
    assert abs(per_micro_batch[0].item() - per_micro_batch[1].item()) > 1e-3  # a real mean
    assert abs(aux["moe/load_balancing_loss"] - want.item()) <= 1e-6 * want.item()
    assert abs(aux["moe/aux_loss"] - COEFF * aux["moe/load_balancing_loss"]) <= 1e-12
    want.backward()
    expected = COEFF * getattr(model.model.layers[0].mlp, ROUTERS[arch]).weight.grad
    assert expected.abs().max() > 0
    assert ((router_grad - expected).abs().max() / expected.abs().max()).item() <= 1e-5
