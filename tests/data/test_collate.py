"""collate_pairs: row order, padding, next-token labels, the padding mask and each item kind's
targets (the completion mask and its scored positions), by hand."""

import pytest
import torch

from dpo_megatron.data import (
    PreferencePair,
    SFTExample,
    UnpairedPair,
    collate_pairs,
    collate_sft,
    padded_length,
)
from dpo_megatron.losses.targets import PairTargets, RewardTargets, SFTTargets, UnpairedTargets

PAD = 0


def test_collate_pairs_layout_by_hand():
    pairs = [
        PreferencePair(prompt_ids=(5, 6), chosen_ids=(7, 2), rejected_ids=(8, 9, 2)),
        PreferencePair(prompt_ids=(11,), chosen_ids=(12,), rejected_ids=(13, 2)),
    ]
    batch, targets = collate_pairs(pairs, pad_token_id=PAD, seq_length=6)
    assert batch.tokens.tolist() == [
        [5, 6, 7, 2, 0, 0],  # pair 0 chosen
        [11, 12, 0, 0, 0, 0],  # pair 1 chosen
        [5, 6, 8, 9, 2, 0],  # pair 0 rejected
        [11, 13, 2, 0, 0, 0],  # pair 1 rejected
    ]
    # 1 exactly where labels[:, t] is a completion token: t from len(prompt)-1 to length-2.
    assert isinstance(targets, PairTargets)
    assert targets.loss_mask.tolist() == [
        [0, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
    ]
    assert batch.position_ids.tolist() == [list(range(6))] * 4
    assert (batch.tokens.dtype, batch.position_ids.dtype) == (torch.int64,) * 2
    assert targets.loss_mask.dtype == torch.float32
    assert batch.segment_ids is None and targets.reference_logps is None and targets.margin is None
    # Padded: the scored tokens sit at the same flat position in both layouts (row * 6 + t).
    assert (
        batch.output_index.tolist() == targets.score_index.tolist() == [1, 2, 6, 13, 14, 15, 18, 19]
    )
    assert batch.num_items == targets.num_items == 2
    # Padding starts after each row's last token (lengths 4, 2, 5, 3).
    assert batch.padding_mask.tolist() == [[t >= n for t in range(6)] for n in (4, 2, 5, 3)]
    # Each scored position predicts the next token: the rows' completions, row by row.
    assert batch.target_ids.tolist() == [7, 2, 12, 8, 9, 2, 13, 2]


def test_collate_exact_fit_and_too_long():
    pair = PreferencePair((1, 2), (3, 4), (5,))
    batch, targets = collate_pairs([pair], pad_token_id=9, seq_length=4)
    assert batch.tokens.tolist() == [[1, 2, 3, 4], [1, 2, 5, 9]]
    assert batch.target_ids.tolist() == [3, 4, 5]
    assert targets.loss_mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match=r"row 0 has 4 tokens .* > seq_length 3"):
        collate_pairs([pair], pad_token_id=9, seq_length=3)


def test_collate_sft_and_padded_length():
    batch, targets = collate_sft([SFTExample((1, 2), (3,))], pad_token_id=0, seq_length=4)
    assert batch.tokens.tolist() == [[1, 2, 3, 0]]
    assert isinstance(targets, SFTTargets)
    assert targets.loss_mask.tolist() == [[0, 1, 0, 0]]
    assert batch.num_items == targets.num_items == 1
    assert padded_length([5, 17, 9]) == 24
    assert padded_length([16]) == 16


def test_precomputed_reference_logps_travel_with_the_pairs():
    pairs = [
        PreferencePair(
            (5, 6), (7, 2), (8, 9, 2), torch.tensor([-1.0, -2.0]), torch.tensor([-5.0, -6.0, -7.0])
        ),
        PreferencePair((5,), (7, 2), (2,), torch.tensor([-3.0, -4.0]), torch.tensor([-8.0])),
    ]
    _, targets = collate_pairs(pairs, 0, 6)
    # loss_mask rows (completion label positions): [1, 2], [0, 1], [1, 2, 3], [0].
    assert targets.reference_logps.tolist() == [
        [0, -1, -2, 0, 0, 0],
        [-3, -4, 0, 0, 0, 0],
        [0, -5, -6, -7, 0, 0],
        [-8, 0, 0, 0, 0, 0],
    ]
    stale = [
        pairs[0],
        PreferencePair((5,), (7, 2), (2,), torch.tensor([-3.0]), torch.tensor([-8.0])),
    ]
    with pytest.raises(ValueError, match="stale"):
        collate_pairs(stale, 0, 6)
    with pytest.raises(ValueError, match="mixes pairs with and without"):
        collate_pairs([pairs[0], PreferencePair((5,), (7, 2), (2,))], 0, 6)


def test_the_model_reads_the_same_micro_batch_whatever_targets_sit_beside_it():
    """A micro-batch holds only the model's inputs: the same rows as pairs (DPO) or as unpaired
    examples (KTO) give equal micro-batches and targets of each kind; a step batch keeps one
    targets record per micro-batch."""
    import dataclasses

    from dpo_megatron.data.batch import StepBatch

    rows = [((5, 6), (7, 2), (8,)), ((11,), (12,), (13, 2))]
    pairs = [PreferencePair(*r) for r in rows]
    examples = [UnpairedPair(*r, desirable=k == 0) for k, r in enumerate(rows)]
    as_pairs, pair_targets = collate_pairs(pairs, PAD, 6)
    as_examples, unpaired_targets = collate_pairs(examples, PAD, 6, kind="unpaired")
    for f in dataclasses.fields(as_pairs):
        a, b = getattr(as_pairs, f.name), getattr(as_examples, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    assert (type(pair_targets), type(unpaired_targets)) == (PairTargets, UnpairedTargets)
    assert torch.equal(pair_targets.score_index, unpaired_targets.score_index)
    with pytest.raises(ValueError, match="2 micro-batches has 1 targets"):
        StepBatch([as_pairs, as_examples], [pair_targets], seq_length=6, real_tokens=20)


def test_each_kind_brings_its_own_targets():
    """Unpaired examples name their labels; a reward model's pairs score each sequence's last
    token that is not padding (and carry the margins), with no label; a reward model's single
    sequences score one token each."""
    examples = [
        UnpairedPair((5, 6), (7, 2), (8,), desirable=True),
        UnpairedPair((11,), (12,), (13, 2), desirable=False),
    ]
    _, unpaired = collate_pairs(examples, pad_token_id=PAD, seq_length=6, kind="unpaired")
    assert isinstance(unpaired, UnpairedTargets)
    assert unpaired.desirable.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="holds a preference pair"):
        collate_pairs([PreferencePair((5,), (7,), (8,))], PAD, 6, kind="unpaired")

    pairs = [
        PreferencePair((5, 6), (7, 2), (8, 9, 2), margin=1.5),
        PreferencePair((11,), (12,), (13, 2)),
    ]
    reward, targets = collate_pairs(pairs, pad_token_id=2, seq_length=6, kind="reward")
    assert isinstance(targets, RewardTargets)
    # Rows as in test_collate_pairs_layout_by_hand; pad id 2 is skipped at a row's end.
    assert targets.last_index.tolist() == [2, 7, 15, 19]
    assert reward.output_index.tolist() == [2, 7, 15, 19] and reward.target_ids is None
    assert targets.margin.tolist() == [1.5, 0.0] and reward.num_items == targets.num_items == 2
    single, targets = collate_sft(
        [SFTExample((1, 2), (3,))], pad_token_id=0, seq_length=4, kind="reward"
    )
    assert single.output_index.tolist() == [2] and single.num_items == targets.num_items == 1
