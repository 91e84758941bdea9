"""The padding mask MoE routers get from a micro-batch (padding stays out of the load-balancing
loss), computed by ``training.step`` from the batch contract. Hand-built pairs, no processes."""

import torch

from dpo_megatron.data import PreferencePair
from dpo_megatron.data.collate import collate_pairs
from dpo_megatron.data.packing import pack_pairs
from dpo_megatron.training.step import padding_mask

PAIRS = [
    PreferencePair(prompt_ids=(5, 6, 7), chosen_ids=(8, 9), rejected_ids=(10, 11, 12, 2)),
    PreferencePair(prompt_ids=(5,), chosen_ids=(8, 2), rejected_ids=(9,)),
]


def test_padded_rows_mask_exactly_the_padding():
    batch, _ = collate_pairs(PAIRS, pad_token_id=0, seq_length=9)
    lengths = [5, 3, 7, 2]  # chosen 0, chosen 1, rejected 0, rejected 1 (prompt + completion)
    want = torch.tensor([[t >= n for t in range(9)] for n in lengths])
    assert torch.equal(padding_mask(batch), want)
    # The pad id also occurs inside sequences (EOS = 2 here): the mask does not look at ids.
    assert batch.tokens[2, 6] == 2 and not padding_mask(batch)[2, 6]


def test_packed_rows_mask_only_the_row_tails():
    batch, _ = pack_pairs(PAIRS, pad_token_id=0, row_length=10)
    mask = padding_mask(batch)
    assert torch.equal(mask, batch.segment_ids < 0)
    assert int((~mask).sum()) == 5 + 3 + 7 + 2  # every token of every sequence, once
    assert mask.any()
