"""Activation recompute (megatron-core selective / full) with packed batches: same loss and
gradient norm as without recompute, on CPU."""

import pytest

from tests.engine import tiny_pairs, tiny_trainer, varied_lengths
from tests.multirank import run_ranks


def _run(granularity, modules=None):
    """Packed training steps of the real trainer without and with recompute."""
    out = {}
    for name in ("none", granularity):
        model = dict(
            num_layers=2,
            tie_word_embeddings=True,
            recompute_granularity=None if name == "none" else name,
            recompute_method="uniform" if name == "full" else None,
            recompute_num_layers=1 if name == "full" else None,
            recompute_modules=modules if name == "selective" else None,
        )
        trainer = tiny_trainer(
            tiny_pairs(6, seed=5, lengths=varied_lengths),
            model=model,
            packing=True,
            seed=3,
            micro_batch_size=3,
            global_batch_size=6,
            steps=2,
            lr=1e-2,
            loss={"name": "sigmoid", "beta": 0.5},
        )
        history = []
        for _ in range(2):
            step, _ = trainer.train_step()
            history.append((step.metrics["loss"], step.grad_norm))
        out[name] = history
    return out


@pytest.mark.parametrize(
    "granularity, modules",
    [("selective", None), ("full", None), ("selective", ["layernorm", "mlp"])],
    ids=["selective", "full", "selective-layernorm-mlp"],
)
def test_recompute_keeps_loss_and_gradient(granularity, modules):
    out = run_ranks(_run, world_size=1, granularity=granularity, modules=modules)[0]
    for (loss, grad), (loss_r, grad_r) in zip(out["none"], out[granularity]):
        assert abs(loss - loss_r) < 1e-6
        assert abs(grad - grad_r) < 1e-6 * grad
