"""Padding-free packing: the layout by hand, and the same log-probs / loss trajectory as padding."""

import pytest
import torch

from dpo_megatron.data import PreferencePair, collate_pairs
from dpo_megatron.data.packing import (
    PackedPairs,
    PackingConfig,
    SharedPromptPairs,
    bucket_micro_batches,
    pack_pairs,
    plan_rows,
)
from dpo_megatron.models.attention import attention_mask_from_segments
from tests.engine import (
    SHALLOW,
    assert_step_zero_is_exact,
    owns_results,
    step_record,
    tiny_pairs,
    tiny_trainer,
    train_step_against_reference,
    varied_lengths,
)
from tests.multirank import run_cases, run_ranks


def test_plan_rows_first_fit_decreasing():
    assert plan_rows([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    assert plan_rows([4, 4, 4], 8) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="unit 1 has 9 tokens"):
        plan_rows([2, 9], 8)


def test_pack_pairs_layout_by_hand():
    # Pair A: prompt (10, 11), chosen (12, 2), rejected (13, 14, 2); pair B: prompt (20,),
    # chosen (21, 2), rejected (22, 2). Lengths: A+c 4, B+c 3, A+r 5, B+r 3; rows of 8.
    pairs = [
        PreferencePair((10, 11), (12, 2), (13, 14, 2)),
        PreferencePair((20,), (21, 2), (22, 2)),
    ]
    out, targets = pack_pairs(pairs, pad_token_id=0, row_length=8)
    # FFD, longest first: A+r (5) row 0; A+c (4) row 1; B+c (3) row 0; B+r (3) row 1.
    assert out.tokens.tolist() == [[10, 11, 13, 14, 2, 20, 21, 2], [10, 11, 12, 2, 20, 22, 2, 0]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 0]]
    assert out.segment_ids.tolist() == [[2, 2, 2, 2, 2, 1, 1, 1], [0, 0, 0, 0, 3, 3, 3, -2]]
    assert out.packed.branch_ids is None  # no shared prompt: one branch
    # One span per sequence (flat positions r * 8 + t), the tail of row 1 its own span.
    assert [(s.q_start, s.q_end, s.keys, s.padding) for s in out.packed.spans] == [
        (0, 5, ((0, 5),), False),
        (5, 8, ((5, 8),), False),
        (8, 12, ((8, 12),), False),
        (12, 15, ((12, 15),), False),
        (15, 16, ((15, 16),), True),
    ]
    assert out.packed.cu_seqlens_q.tolist() == [0, 5, 8, 12, 15, 16]
    assert torch.equal(out.packed.cu_seqlens_kv, out.packed.cu_seqlens_q)
    assert out.packed.kv_index is None and out.packed.max_seqlen_q == 5
    visible = ~attention_mask_from_segments(out.segment_ids)[:, 0]
    assert visible[0, 6].tolist() == [False] * 5 + [True, True, False]  # B+c sees only itself
    assert visible[1, 7].tolist() == [False] * 7 + [True]  # the tail: itself
    padded, padded_targets = collate_pairs(pairs, pad_token_id=0, seq_length=5)
    assert torch.equal(targets.loss_mask, padded_targets.loss_mask)
    # Scored tokens: A+c at row 1, B+c at row 0 (offset 5), A+r at row 0, B+r at row 1 (offset 4).
    assert out.output_index.tolist() == [9, 10, 5, 6, 1, 2, 3, 12, 13]
    assert torch.equal(targets.score_index, padded_targets.score_index)
    # the same tokens, scored in the same order
    assert torch.equal(
        out.tokens.reshape(-1)[out.output_index],
        padded.tokens.reshape(-1)[padded_targets.score_index],
    )
    assert torch.equal(out.target_ids, padded.target_ids)
    assert padded.target_ids.tolist() == [12, 2, 21, 2, 13, 14, 2, 22, 2]


def test_a_long_tail_is_cut_into_short_padding_spans():
    """A varlen kernel computes every span it is given: an unused tail of 294 positions as one
    causal span would cost it as much as a 294-token sequence."""
    pairs = [PreferencePair((10, 11), (12,), (13,))]
    out, _ = pack_pairs(pairs, pad_token_id=0, row_length=300)
    tail = [(s.q_start, s.q_end, s.keys) for s in out.packed.spans if s.padding]
    assert tail == [(6, 134, ((6, 134),)), (134, 262, ((134, 262),)), (262, 300, ((262, 300),))]
    assert out.packed.cu_seqlens_q.tolist() == [0, 3, 6, 134, 262, 300]
    assert out.packed.max_seqlen_q == 128


def test_every_micro_batch_of_a_step_has_one_shape():
    pairs = [
        PreferencePair((1,) * n, (2,) * m, (3,) * k)
        for n, m, k in [(3, 2, 5), (1, 1, 1), (6, 1, 2), (2, 2, 2)]
    ]
    real = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    # Default: one row per micro-batch holding all its sequences. Sequence lengths [5, 2, 8, 2]
    # (17 tokens) and [7, 4, 8, 4] (23): rows of 23 rounded up to 24, only 7 + 1 padding.
    step = PackedPairs(0, 4, PackingConfig(enabled=True)).build(pairs, [[0, 1], [2, 3]])
    assert step.seq_length == 24 and step.real_tokens == step.model_tokens == real == 40
    assert [tuple(mb.tokens.shape) for mb in step.micro_batches] == [(1, 24), (1, 24)]
    assert step.micro_batches[0].packed.spans[-1].padding  # 17..23: the tail
    # Rows of a given length (first-fit decreasing): [8], [5, 2], [2] and [8], [7], [4, 4].
    builder = PackedPairs(0, 4, PackingConfig(enabled=True, row_length=8))
    step = builder.build(pairs, [[0, 1], [2, 3]])
    assert step.seq_length == 8
    assert [tuple(mb.tokens.shape) for mb in step.micro_batches] == [(3, 8), (3, 8)]
    small = builder.build(pairs, [[0, 1], [3]]).micro_batches
    assert [tuple(mb.tokens.shape) for mb in small] == [(3, 8), (3, 8)]
    assert small[1].tokens[2].tolist() == [0] * 8  # the empty row appended


def test_a_builder_computing_one_side_attaches_the_other_for_the_statistic():
    """KTO's step (``BatchBuilder.computing``): the examples' own sequences in the step's
    micro-batches, the mismatched ones in the statistic's; each side's rows keep their place in
    the per-sequence layout, with nothing scored where the other side is computed, and its
    precomputed reference values; the tokens of both count once."""
    from dpo_megatron.data.pairs import UnpairedPair

    pairs = [
        UnpairedPair((10, 11), (12, 2), (13, 14, 2), desirable=True),
        UnpairedPair((20,), (21, 2), (22, 2), desirable=False),
    ]
    for k, p in enumerate(pairs):
        object.__setattr__(p, "reference_chosen_logps", torch.tensor([-1.0, -2.0]) - 10 * k)
        object.__setattr__(p, "reference_rejected_logps", -torch.arange(len(p.rejected_ids)) - 0.5)
    builder = PackedPairs(0, 4, PackingConfig(enabled=True), kind="unpaired")
    both = builder.build(pairs, [[0, 1]])
    split = builder.computing(("chosen",), ("rejected",)).build(pairs, [[0, 1]])
    main, stat = split.micro_batches[0], split.statistic.micro_batches[0]
    full = both.micro_batches[0]
    assert main.tokens[0, :7].tolist() == [10, 11, 12, 2, 20, 21, 2]  # the examples only
    assert stat.tokens[0, :8].tolist() == [10, 11, 13, 14, 2, 20, 22, 2]  # the KL sequences
    chosen, rejected = torch.tensor([1.0, 1, 0, 0]), torch.tensor([0.0, 0, 1, 1])
    main_t, stat_t, full_t = split.targets[0], split.statistic.targets[0], both.targets[0]
    assert torch.equal(main_t.loss_mask.sum(-1).bool().float(), chosen)
    assert torch.equal(stat_t.loss_mask.sum(-1).bool().float(), rejected)
    assert torch.equal(main_t.loss_mask + stat_t.loss_mask, full_t.loss_mask)
    assert torch.equal(main_t.reference_logps + stat_t.reference_logps, full_t.reference_logps)
    # the same scored tokens, split between the two
    assert main.target_ids.tolist() + stat.target_ids.tolist() == full.target_ids.tolist()
    assert split.item_indices == split.statistic.item_indices == [(0, 1)]
    assert torch.equal(main_t.desirable, torch.tensor([1.0, 0.0]))
    assert split.real_tokens == both.real_tokens == 4 + 3 + 5 + 3
    assert split.model_tokens == both.model_tokens and both.statistic is None
    # shared-prompt units hold both sides: that builder computes every sequence
    shared = SharedPromptPairs(0, 4, PackingConfig(enabled=True, share_prompt=True))
    assert shared.computing(("chosen",), ("rejected",)) is shared
    with pytest.raises(ValueError, match="unknown sides"):
        builder.computing(("prompt",))


def test_bucket_by_length_keeps_the_pair_set():
    pairs = [PreferencePair((1,), (2,) * n, (3,)) for n in (10, 90, 20, 80)]
    assert bucket_micro_batches(pairs, [[0, 1], [2, 3]]) == [[1, 3], [2, 0]]


def _compare(tp=1, pp=1, steps=3, micro_batch_size=3, learned=False, lr=1e-2, model=None, **config):
    """The real trainer with padded and with packed batches, from the same seed; step 0 also
    says whether the policy's log-probs equal the reference's bit for bit."""
    model = dict(
        **SHALLOW,
        position_embedding_type="learned_absolute" if learned else "rope",
        normalization="LayerNorm" if learned else "RMSNorm",
        activation="gelu" if learned else "swiglu",
        **(model or {}),
    )
    history = {}
    for packed in (False, True):
        trainer = tiny_trainer(
            tiny_pairs(6, seed=5, lengths=varied_lengths),
            tp=tp,
            pp=pp,
            model=model,
            packing=packed,
            seed=3,
            micro_batch_size=micro_batch_size,
            global_batch_size=6,
            steps=steps,
            lr=lr,
            loss={"name": "sigmoid", "beta": 0.5},
            **config,
        )
        history[packed] = [step_record(*train_step_against_reference(trainer))]
        history[packed] += [step_record(*trainer.train_step()) for _ in range(steps - 1)]
        for k in history[packed]:
            k["loss"] = k["metrics"]["loss"]
    return {"last": owns_results(), "history": history}


def assert_same_trajectory(reference, other, logps_rtol=1e-6, loss_atol=1e-5):
    """Step 0 (same weights): per-sequence log-probs within ``logps_rtol`` relative; every step:
    loss within ``loss_atol`` and gradient norm within 1e-5 relative. (After an Adam step at
    lr 1e-2, summation-order differences of 1e-7 in the layers are amplified on near-zero
    gradients, so later log-probs are compared through the loss.)"""
    for key in ("logps/chosen", "logps/rejected"):
        want = torch.tensor(reference[0]["per_item"][key], dtype=torch.float64)
        got = torch.tensor(other[0]["per_item"][key], dtype=torch.float64)
        assert ((got - want).abs() <= logps_rtol * want.abs()).all(), (key, got, want)
    assert len(reference) == len(other)
    for step, (a, b) in enumerate(zip(reference, other)):
        assert abs(a["loss"] - b["loss"]) < loss_atol, step
        if a["grad_norm"] is not None:
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * a["grad_norm"], step


@pytest.mark.parametrize("learned", [False, True], ids=["rope", "learned_absolute"])
def test_packed_equals_padded_fp32(learned):
    result = run_ranks(_compare, world_size=1, learned=learned)[0]
    padded, packed = result["history"][False], result["history"][True]
    assert packed[0]["shape"][0] < padded[0]["shape"][0]  # fewer rows: padding removed
    assert_same_trajectory(padded, packed)


@pytest.mark.slow
def test_packed_equals_padded_tp2_pp2_and_tp4():
    """Packed rows attend span by span, padded rows in one batched call, so their sums run in
    another order: at lr 1e-2 the step-1 gradient norms at TP 2 x PP 2 differed by 8.5e-5
    relative (Adam amplifies the difference on near-zero gradients, see
    :func:`assert_same_trajectory`); lr 1e-3 keeps the step small enough that the 1e-5 bound
    tests the packing and not that amplification. Step 0 is compared at full precision, and at
    step 0 policy and reference log-probs are bit-identical, padded and packed, at TP 2 x PP 2
    and at TP 4 (in the same 4-rank world)."""
    runs = run_cases(
        4,
        {
            "tp2_pp2": (_compare, dict(tp=2, pp=2, steps=2, lr=1e-3)),
            "tp4": (_compare, dict(tp=4, steps=1, model={"num_query_groups": 4})),
        },
    )
    for name, results in runs.items():
        last = next(r for r in results if r["last"])
        assert_same_trajectory(last["history"][False], last["history"][True])
        for packed in (False, True):
            assert_step_zero_is_exact(last["history"][packed][0])


def _step_zero_rewards(share_prompt):
    pairs = tiny_pairs(8)
    trainer = tiny_trainer(
        pairs,
        packing=True,
        share_prompt=share_prompt,
        micro_batch_size=4,
        global_batch_size=8,
        steps=1,
        seed=3,
    )
    out, batch = trainer.train_step()
    return {
        "rows": [mb.tokens.shape[0] for mb in batch.micro_batches],
        "rewards": {k: out.per_item[k].tolist() for k in ("rewards/chosen", "rewards/rejected")},
        "loss": out.metrics["loss"],
    }


@pytest.mark.parametrize("share_prompt", [False, True], ids=["packed", "shared_prompt"])
def test_step_zero_rewards_are_exactly_zero_on_packed_rows(share_prompt):
    """At step 0 policy and reference hold the same weights, so every reward is exactly 0 and
    the loss is fp32 -log sigmoid(0), bit for bit, however the pairs pack. A micro-batch packed
    into one row gives the layers' inputs strides (h, s * h, 1), on which torch.matmul runs a
    frozen weight (the reference's) through another kernel than a trainable one unless
    ``compat.frozen_linear_fold`` is on. TP 2 x PP 2 and TP 4: the packed-equals-padded test
    above; more layouts: the shared-prompt layout test."""
    result = run_ranks(_step_zero_rewards, world_size=1, share_prompt=share_prompt)[0]
    assert 1 in result["rows"]  # a one-row micro-batch: the case that differed
    for key, values in result["rewards"].items():
        assert values == [0.0] * 8, (key, values)
    assert result["loss"] == float(-torch.nn.functional.logsigmoid(torch.zeros(())))
