"""Padding-free packing: the layout by hand, and the same log-probs / loss trajectory as padding."""

import pytest
import torch

from dpo_megatron.data import PreferencePair, collate_pairs
from dpo_megatron.data.packing import PackedPairs, PackingConfig, bucket_micro_batches, pack_pairs, plan_rows
from dpo_megatron.models.attention import attention_mask_from_segments
from tests.engine import owns_results, random_pairs, step_record, tiny_trainer
from tests.multirank import run_ranks


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
    assert out.tokens.tolist() == [[10, 11, 13, 14, 2, 20, 21, 2],
                                      [10, 11, 12, 2, 20, 22, 2, 0]]
    assert out.labels.tolist() == [[11, 13, 14, 2, 0, 21, 2, 0],
                                      [11, 12, 2, 0, 22, 2, 0, 0]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2],
                                            [0, 1, 2, 3, 0, 1, 2, 0]]
    assert out.segment_ids.tolist() == [[2, 2, 2, 2, 2, 1, 1, 1], [0, 0, 0, 0, 3, 3, 3, -2]]
    visible = ~attention_mask_from_segments(out.segment_ids)[:, 0]
    assert visible[0, 6].tolist() == [False] * 5 + [True, True, False]   # B+c sees only itself
    assert visible[1, 7].tolist() == [False] * 7 + [True]                # the tail: itself
    padded = collate_pairs(pairs, pad_token_id=0, seq_length=5)
    assert torch.equal(out.loss_mask, padded.loss_mask)
    # Scored tokens: A+c at row 1, B+c at row 0 (offset 5), A+r at row 0, B+r at row 1 (offset 4).
    assert out.output_index.tolist() == [9, 10, 5, 6, 1, 2, 3, 12, 13]
    assert torch.equal(out.score_index, padded.score_index)
    for key in ("tokens", "labels"):  # the same tokens, scored in the same order
        assert torch.equal(getattr(out, key).reshape(-1)[out.output_index],
                           getattr(padded, key).reshape(-1)[padded.score_index])


def test_every_micro_batch_of_a_step_has_one_shape():
    pairs = [PreferencePair((1,) * n, (2,) * m, (3,) * k) for n, m, k in
             [(3, 2, 5), (1, 1, 1), (6, 1, 2), (2, 2, 2)]]
    builder = PackedPairs(0, 4, PackingConfig(enabled=True))
    step = builder.build(pairs, [[0, 1], [2, 3]])
    mbs, length, real = step.micro_batches, step.seq_length, step.real_tokens
    assert length == 8  # longest sequence: 3 + 5 = 6 + 2 = 8, already a multiple of 4
    # Sequence lengths [5, 2, 8, 2] need 3 rows of 8 ([8], [5, 2], [2]); [7, 4, 8, 4] need
    # 3 too; with 1-token pairs the second would need fewer and be padded up to the first.
    assert [tuple(mb.tokens.shape) for mb in mbs] == [(3, 8), (3, 8)]
    small = builder.build(pairs, [[0, 1], [3]]).micro_batches
    assert [tuple(mb.tokens.shape) for mb in small] == [(3, 8), (3, 8)]
    assert small[1].tokens[2].tolist() == [0] * 8  # the empty row appended
    assert real == sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)


def test_bucket_by_length_keeps_the_pair_set():
    pairs = [PreferencePair((1,), (2,) * n, (3,)) for n in (10, 90, 20, 80)]
    assert bucket_micro_batches(pairs, [[0, 1], [2, 3]]) == [[1, 3], [2, 0]]


def _pairs(n=6, seed=5):  # lengths vary widely, as in real preference data
    return random_pairs(n, seed, lambda i: (2 + (7 * i) % 11, 1 + (5 * i) % 9, 3 + (3 * i) % 13))


def _compare(tp=1, pp=1, steps=3, micro_batch_size=3, learned=False, **config):
    """The real trainer with padded and with packed batches, from the same seed."""
    model = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, tie_word_embeddings=True,
                 position_embedding_type="learned_absolute" if learned else "rope",
                 normalization="LayerNorm" if learned else "RMSNorm",
                 activation="gelu" if learned else "swiglu")
    history = {}
    for packed in (False, True):
        trainer = tiny_trainer(_pairs(), tp=tp, pp=pp, model=model, packing=packed, seed=3,
                               micro_batch_size=micro_batch_size, global_batch_size=6,
                               steps=steps, lr=1e-2, loss={"name": "sigmoid", "beta": 0.5},
                               **config)
        history[packed] = [step_record(*trainer.train_step()) for _ in range(steps)]
        for k in history[packed]:
            k["loss"] = k["metrics"]["loss"]
    return {"last": owns_results(), "history": history}


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
