"""Activation recompute (megatron-core selective / full) with packed batches: same loss and
gradient norm as without recompute, on CPU."""

import pytest

from tests.multirank import run_ranks
from tests.training.test_packing import VOCAB, _pairs


def _run(granularity):
    from dpo_megatron.data.packing import build_packed_micro_batches
    from dpo_megatron.losses import build_loss
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed
    from dpo_megatron.training.config import TrainConfig
    from dpo_megatron.training.optim import build_optimizer, copy_weights, freeze, wrap_ddp
    from dpo_megatron.training.step import train_step

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    out = {}
    for name in ("none", granularity):
        model_cfg = ModelConfig(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, vocab_size=VOCAB,
            recompute_granularity=None if name == "none" else name,
            recompute_method="uniform" if name == "full" else None,
            recompute_num_layers=1 if name == "full" else None)
        set_seed(3)
        policy = build_model_chunks(model_cfg, parallel)
        reference = freeze(build_model_chunks(model_cfg, parallel))
        copy_weights(policy, reference)
        policy = wrap_ddp(policy, use_distributed_optimizer=True)
        optimizer, scheduler = build_optimizer(policy, TrainConfig(lr=1e-2, train_iters=2,
                                                                   lr_decay_style="constant"))
        loss_fn = build_loss({"name": "sigmoid", "beta": 0.5})
        pairs = _pairs()
        history = []
        for _ in range(2):
            mbs, seq_length, _ = build_packed_micro_batches(pairs, [[0, 1, 2], [3, 4, 5]], 0, 8)
            step = train_step(policy, reference, optimizer, scheduler, mbs, seq_length, loss_fn)
            history.append((step.metrics["loss"], step.grad_norm))
        out[name] = history
    return out


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_keeps_loss_and_gradient(granularity):
    out = run_ranks(_run, world_size=1, granularity=granularity)[0]
    for (loss, grad), (loss_r, grad_r) in zip(out["none"], out[granularity]):
        assert abs(loss - loss_r) < 1e-6
        assert abs(grad - grad_r) < 1e-6 * grad
