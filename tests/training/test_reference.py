"""Reference modes: precomputed (cached) and offloaded reference give the loss of ``model`` mode."""

import pytest
import torch

from dpo_megatron.data import PreferencePair, collate_pairs
from dpo_megatron.models import ModelConfig
from dpo_megatron.training.reference import (
    ReferenceConfig,
    ReferenceTable,
    attach_precomputed,
    reference_cache_key,
)
from tests.multirank import run_ranks

VOCAB = 256


def test_table_round_trip(tmp_path):
    table = ReferenceTable([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
                           [torch.tensor([-3.0]), torch.tensor([-4.0, -5.0, -6.0])])
    table.save(tmp_path / "t.pt")
    back = ReferenceTable.load(tmp_path / "t.pt")
    assert [t.tolist() for t in back.chosen] == [[-1.0, -2.0], [-0.5]]
    assert [t.tolist() for t in back.rejected] == [[-3.0], [-4.0, -5.0, -6.0]]


def test_attach_precomputed_places_values_on_completion_positions():
    pairs = [PreferencePair((5, 6), (7, 2), (8, 9, 2)), PreferencePair((5,), (7, 2), (2,))]
    table = ReferenceTable([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0])],
                           [torch.tensor([-5.0, -6.0, -7.0]), torch.tensor([-8.0])])
    batch = collate_pairs(pairs, 0, 6)
    attach_precomputed([batch], [[0, 1]], table)
    # loss_mask rows (completion label positions): [1, 2], [0, 1], [1, 2, 3], [0].
    assert batch["reference_token_logps"].tolist() == [
        [0, -1, -2, 0, 0, 0], [-3, -4, 0, 0, 0, 0], [0, -5, -6, -7, 0, 0], [-8, 0, 0, 0, 0, 0]]
    stale = ReferenceTable(table.chosen, [torch.tensor([-5.0]), torch.tensor([-8.0])])
    with pytest.raises(ValueError, match="stale"):
        attach_precomputed([collate_pairs(pairs, 0, 6)], [[0, 1]], stale)


def test_cache_key_follows_tokens_model_and_seed():
    pairs = [PreferencePair((5, 6), (7, 2), (8, 2))]
    model = ModelConfig()
    key = reference_cache_key(pairs, model, seed=1)
    assert key == reference_cache_key(list(pairs), ModelConfig(), seed=1)
    assert key != reference_cache_key([PreferencePair((5, 6), (7, 2), (9, 2))], model, seed=1)
    assert key != reference_cache_key(pairs, ModelConfig(num_layers=3), seed=1)
    assert key != reference_cache_key(pairs, model, seed=2)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="reference.mode='cached'; known: model, precomputed"):
        ReferenceConfig(mode="cached").validate()


def _pairs(n=6, seed=9):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lp, lc, lr = 2 + (5 * i) % 7, 1 + (3 * i) % 8, 2 + (7 * i) % 9
        p, c, r = (tuple(torch.randint(3, VOCAB, (k,), generator=g).tolist()) for k in (lp, lc, lr))
        out.append(PreferencePair(p, c + (2,), r + (2,)))
    return out


def _trajectories(cache_dir, steps=3):
    from dpo_megatron.losses import build_loss
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed
    from dpo_megatron.models import build_model_chunks
    from dpo_megatron.training.batches import build_step_batches
    from dpo_megatron.data.packing import PackingConfig
    from dpo_megatron.training.config import TrainConfig
    from dpo_megatron.training.optim import build_optimizer, copy_weights, freeze, wrap_ddp
    from dpo_megatron.training.reference import build_reference_source
    from dpo_megatron.training.step import train_step

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    model_cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                            num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB)
    pairs = _pairs()
    indices = [[0, 1], [2, 3], [4, 5]]
    runs = {"model": ("model", False, False), "precomputed": ("precomputed", False, False),
            "precomputed_again": ("precomputed", False, False),
            "precomputed_packed": ("precomputed", False, True), "offload": ("model", True, False)}
    out = {}
    for name, (mode, offload, packed) in runs.items():
        set_seed(3)
        policy = build_model_chunks(model_cfg, parallel)
        reference = freeze(build_model_chunks(model_cfg, parallel))
        copy_weights(policy, reference)
        calls = []
        reference[0].register_forward_hook(lambda *_: calls.append(1))
        policy = wrap_ddp(policy, use_distributed_optimizer=True)
        optimizer, scheduler = build_optimizer(policy, TrainConfig(lr=1e-2, train_iters=steps,
                                                                   lr_decay_style="constant"))
        loss_fn = build_loss({"name": "sigmoid", "beta": 0.5})
        cfg = ReferenceConfig(mode=mode, offload=offload, cache_dir=cache_dir)
        source = build_reference_source(cfg, reference, pairs, 0, 8, 2, model_cfg, seed=3,
                                        packed=packed)
        before_training = len(calls)
        losses = []
        for _ in range(steps):
            mbs, seq_length, _, idx = build_step_batches(pairs, indices, 0, 8,
                                                         PackingConfig(enabled=packed))
            source.attach(mbs, idx, seq_length)
            step = train_step(policy, reference, optimizer, scheduler, mbs, seq_length, loss_fn,
                              reference_attached=True)
            losses.append(step.metrics["loss"])
        out[name] = {"losses": losses, "precompute_calls": before_training,
                     "training_calls": len(calls) - before_training}
    return out


def test_precomputed_and_offload_give_the_model_mode_loss(tmp_path):
    out = run_ranks(_trajectories, world_size=1, cache_dir=str(tmp_path))[0]
    want = out["model"]["losses"]
    for name in ("precomputed", "precomputed_again", "precomputed_packed", "offload"):
        for a, b in zip(out[name]["losses"], want, strict=True):
            assert abs(a - b) < 1e-5, (name, out[name]["losses"], want)
    assert out["model"]["training_calls"] == 3 * 3  # 3 steps x 3 micro-batches
    assert out["precomputed"]["precompute_calls"] == 3 and out["precomputed"]["training_calls"] == 0
    # The second run with the same model, data and seed reads the cache: no forward at all.
    assert out["precomputed_again"]["precompute_calls"] == 0
    assert out["precomputed_again"]["training_calls"] == 0
    assert len(list(tmp_path.glob("reference-*.pt"))) == 1
