"""collate_pairs: row order, padding, next-token labels and the completion mask, by hand."""

import pytest
import torch

from dpo_megatron.data import PreferencePair, SFTExample, collate_pairs, collate_sft, padded_length

PAD = 0


def test_collate_pairs_layout_by_hand():
    pairs = [
        PreferencePair(prompt_ids=(5, 6), chosen_ids=(7, 2), rejected_ids=(8, 9, 2)),
        PreferencePair(prompt_ids=(11,), chosen_ids=(12,), rejected_ids=(13, 2)),
    ]
    batch = collate_pairs(pairs, pad_token_id=PAD, seq_length=6)
    assert batch["tokens"].tolist() == [
        [5, 6, 7, 2, 0, 0],  # pair 0 chosen
        [11, 12, 0, 0, 0, 0],  # pair 1 chosen
        [5, 6, 8, 9, 2, 0],  # pair 0 rejected
        [11, 13, 2, 0, 0, 0],  # pair 1 rejected
    ]
    assert batch["labels"].tolist() == [
        [6, 7, 2, 0, 0, 0],
        [12, 0, 0, 0, 0, 0],
        [6, 8, 9, 2, 0, 0],
        [13, 2, 0, 0, 0, 0],
    ]
    # 1 exactly where labels[:, t] is a completion token: t from len(prompt)-1 to length-2.
    assert batch["loss_mask"].tolist() == [
        [0, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
    ]
    assert batch["position_ids"].tolist() == [list(range(6))] * 4
    assert {k: v.dtype for k, v in batch.items()} == {
        "tokens": torch.int64,
        "labels": torch.int64,
        "loss_mask": torch.float32,
        "position_ids": torch.int64,
    }
    # The masked labels are exactly each row's completion.
    for row, completion in enumerate([(7, 2), (12,), (8, 9, 2), (13, 2)]):
        mask = batch["loss_mask"][row].bool()
        assert tuple(batch["labels"][row][mask].tolist()) == completion


def test_collate_exact_fit_and_too_long():
    pair = PreferencePair((1, 2), (3, 4), (5,))
    batch = collate_pairs([pair], pad_token_id=9, seq_length=4)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4], [1, 2, 5, 9]]
    assert batch["labels"].tolist() == [[2, 3, 4, 9], [2, 5, 9, 9]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match=r"row 0 has 4 tokens .* > seq_length 3"):
        collate_pairs([pair], pad_token_id=9, seq_length=3)


def test_collate_sft_and_padded_length():
    batch = collate_sft([SFTExample((1, 2), (3,))], pad_token_id=0, seq_length=4)
    assert batch["tokens"].tolist() == [[1, 2, 3, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 0]]
    assert padded_length([5, 17, 9]) == 24
    assert padded_length([16]) == 16
