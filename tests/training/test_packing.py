"""Padding-free packing: the layout by hand, and the same log-probs / loss trajectory as padding."""

import pytest
import torch

from dpo_megatron.data import PreferencePair, collate_pairs
from dpo_megatron.data.packing import (
    bucket_micro_batches,
    build_packed_micro_batches,
    pack_pairs,
    plan_rows,
    unpack_token_values,
)
from tests.multirank import run_ranks

VOCAB = 256


def test_plan_rows_first_fit_decreasing():
    assert plan_rows([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    assert plan_rows([4, 4, 4], 8) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens"):
        plan_rows([2, 9], 8)


def test_pack_pairs_layout_by_hand():
    # Pair A: prompt (10, 11), chosen (12, 2), rejected (13, 14, 2); pair B: prompt (20,),
    # chosen (21, 2), rejected (22, 2). Lengths: A+c 4, B+c 3, A+r 5, B+r 3; rows of 8.
    pairs = [PreferencePair((10, 11), (12, 2), (13, 14, 2)), PreferencePair((20,), (21, 2), (22, 2))]
    out = pack_pairs(pairs, pad_token_id=0, row_length=8)
    # FFD, longest first: A+r (5) row 0; A+c (4) row 1; B+c (3) row 0; B+r (3) row 1.
    assert out["tokens"].tolist() == [[10, 11, 13, 14, 2, 20, 21, 2],
                                      [10, 11, 12, 2, 20, 22, 2, 0]]
    assert out["labels"].tolist() == [[11, 13, 14, 2, 0, 21, 2, 0],
                                      [11, 12, 2, 0, 22, 2, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2],
                                            [0, 1, 2, 3, 0, 1, 2, 0]]
    visible = ~out["attention_mask"][:, 0]
    assert visible[0, 6].tolist() == [False] * 5 + [True, True, False]   # B+c sees only itself
    assert visible[1, 7].tolist() == [False] * 7 + [True]                # the tail: itself
    assert out["unpack_index"].tolist() == [[8, 9, 10, 11, 0], [5, 6, 7, 0, 0],
                                            [0, 1, 2, 3, 4], [12, 13, 14, 0, 0]]
    padded = collate_pairs(pairs, pad_token_id=0, seq_length=5)
    assert torch.equal(out["loss_mask"], padded["loss_mask"])
    mask = padded["loss_mask"].bool()
    for key in ("tokens", "labels"):
        unpacked = unpack_token_values(out[key], out["unpack_index"])
        assert torch.equal(unpacked[mask], padded[key][mask])


def test_every_micro_batch_of_a_step_has_one_shape():
    pairs = [PreferencePair((1,) * n, (2,) * m, (3,) * k) for n, m, k in
             [(3, 2, 5), (1, 1, 1), (6, 1, 2), (2, 2, 2)]]
    mbs, length, real = build_packed_micro_batches(pairs, [[0, 1], [2, 3]], 0, multiple=4)
    assert length == 8  # longest sequence: 3 + 5 = 6 + 2 = 8, already a multiple of 4
    # Sequence lengths [5, 2, 8, 2] need 3 rows of 8 ([8], [5, 2], [2]); [7, 4, 8, 4] need
    # 3 too; with 1-token pairs the second would need fewer and be padded up to the first.
    assert [tuple(mb["tokens"].shape) for mb in mbs] == [(3, 8), (3, 8)]
    small, _, _ = build_packed_micro_batches(pairs, [[0, 1], [3]], 0, multiple=4)
    assert [tuple(mb["tokens"].shape) for mb in small] == [(3, 8), (3, 8)]
    assert small[1]["tokens"][2].tolist() == [0] * 8  # the empty row appended
    assert real == sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)


def test_bucket_by_length_keeps_the_pair_set():
    pairs = [PreferencePair((1,), (2,) * n, (3,)) for n in (10, 90, 20, 80)]
    assert bucket_micro_batches(pairs, [[0, 1], [2, 3]]) == [[1, 3], [2, 0]]


def _pairs(n=6, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):  # lengths vary widely, as in real preference data
        lp, lc, lr = 2 + (7 * i) % 11, 1 + (5 * i) % 9, 3 + (3 * i) % 13
        p, c, r = (tuple(torch.randint(3, VOCAB, (k,), generator=g).tolist()) for k in (lp, lc, lr))
        out.append(PreferencePair(p, c + (2,), r + (2,)))
    return out


def _compare(tp=1, pp=1, steps=3, micro_batch_size=3, learned=False):
    from megatron.core import parallel_state as ps

    from dpo_megatron.losses import build_loss
    from dpo_megatron.models import ModelConfig, build_model_chunks
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed
    from dpo_megatron.training.batches import build_micro_batches
    from dpo_megatron.training.config import TrainConfig
    from dpo_megatron.training.optim import build_optimizer, copy_weights, freeze, wrap_ddp
    from dpo_megatron.training.step import train_step

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    initialize_distributed(parallel)
    model_cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                            num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                            position_embedding_type="learned_absolute" if learned else "rope",
                            normalization="LayerNorm" if learned else "RMSNorm",
                            activation="gelu" if learned else "swiglu")
    pairs = _pairs()
    indices = [list(range(i, i + micro_batch_size)) for i in range(0, len(pairs), micro_batch_size)]
    history = {}
    for packed in (False, True):
        set_seed(3)
        policy = build_model_chunks(model_cfg, parallel)
        reference = freeze(build_model_chunks(model_cfg, parallel))
        copy_weights(policy, reference)
        policy = wrap_ddp(policy, use_distributed_optimizer=True)
        optimizer, scheduler = build_optimizer(policy, TrainConfig(lr=1e-2, train_iters=steps,
                                                                   lr_decay_style="constant"))
        loss_fn = build_loss({"name": "sigmoid", "beta": 0.5})
        rows = []
        for _ in range(steps):
            build = build_packed_micro_batches if packed else build_micro_batches
            mbs, seq_length, _ = build(pairs, indices, 0, 8 * tp)
            out = train_step(policy, reference, optimizer, scheduler, mbs, seq_length, loss_fn)
            rows.append({"loss": out.metrics["loss"], "grad_norm": out.grad_norm,
                         "per_pair": {k: v.tolist() for k, v in out.per_pair.items()},
                         "shape": list(mbs[0]["tokens"].shape)})
        history[packed] = rows
    return {"last": ps.is_pipeline_last_stage(), "history": history}


@pytest.mark.parametrize("learned", [False, True], ids=["rope", "learned_absolute"])
def test_packed_equals_padded_fp32(learned):
    result = run_ranks(_compare, world_size=1, learned=learned)[0]
    padded, packed = result["history"][False], result["history"][True]
    assert packed[0]["shape"][0] < padded[0]["shape"][0]  # fewer rows: padding removed
    for step, (a, b) in enumerate(zip(padded, packed)):
        for key in ("logps/chosen", "logps/rejected"):
            torch.testing.assert_close(torch.tensor(b["per_pair"][key]),
                                       torch.tensor(a["per_pair"][key]), rtol=1e-6, atol=1e-5)
        assert abs(a["loss"] - b["loss"]) < 1e-5, step
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * a["grad_norm"], step


@pytest.mark.slow
def test_packed_equals_padded_tp2_pp2():
    results = run_ranks(_compare, world_size=4, tp=2, pp=2, steps=2)
    last = next(r for r in results if r["last"])
    for a, b in zip(last["history"][False], last["history"][True]):
        assert abs(a["loss"] - b["loss"]) < 1e-5
    # Step 0 (same weights): per-pair log-probs agree to 1e-6 relative. After an Adam step at
    # lr 1e-2 the TP-reduction order differences (1e-7) are amplified on near-zero gradients.
    a, b = last["history"][False][0], last["history"][True][0]
    for key in ("logps/chosen", "logps/rejected"):
        torch.testing.assert_close(torch.tensor(b["per_pair"][key]),
                                   torch.tensor(a["per_pair"][key]), rtol=1e-6, atol=1e-5)
