"""The context-parallel batch split (``data.context_split``) and the CP config rules: single
process, hand-checked positions."""

import pytest
import torch

from dpo_megatron.config import load_config, world_size_for
from dpo_megatron.data.batch import make_batch_builder
from dpo_megatron.data.context_split import local_positions, split_micro_batch
from dpo_megatron.data.packing import PackingConfig
from dpo_megatron.parallel.context import chunk_positions
from tests.engine import random_pairs


def test_chunk_positions_are_megatron_cores_load_balanced_layout():
    assert chunk_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert chunk_positions(8, 3, 4).tolist() == [3, 4]
    assert chunk_positions(5, 0, 1).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        chunk_positions(6, 0, 2)


def _pairs():
    return random_pairs(3, seed=1, lengths=lambda i: (3 + i, 2 + 2 * i, 5 - i))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_ranks_share_every_token_once_with_its_label_and_position(packed, cp):
    packing = PackingConfig(enabled=packed)
    full_builder = make_batch_builder(0, 2 * cp, packing)
    if packed:  # the CP builder pads each packed sequence to 2 x CP; so does this reference
        full_builder.segment_multiple = 2 * cp
    full = full_builder.build(_pairs(), [[0, 1, 2]]).micro_batches[0]
    rows, length = full.tokens.shape
    seen = torch.zeros(rows, length, dtype=torch.int64)
    scored = []
    for rank in range(cp):
        step = make_batch_builder(0, 2 * cp, packing, context_parallel=(rank, cp)).build(
            _pairs(), [[0, 1, 2]])
        part = step.micro_batches[0]
        assert step.seq_length == length  # the schedule divides by CP itself
        assert part.tokens.shape == (rows, length // cp)
        keep = local_positions(full, rank, cp)
        seen.scatter_add_(1, keep, torch.ones_like(keep))
        for name in ("tokens", "labels", "position_ids"):
            assert torch.equal(getattr(part, name), getattr(full, name).gather(1, keep))
        # Each scored token keeps its label and its per-sequence slot.
        local_labels = part.labels.reshape(-1)[part.output_index]
        for label, slot in zip(local_labels.tolist(), part.score_index.tolist()):
            k = full.score_index.tolist().index(slot)
            assert full.labels.reshape(-1)[full.output_index[k]].item() == label
            scored.append(slot)
        assert torch.equal(part.loss_mask, full.loss_mask)  # per-sequence layout kept whole
    assert bool((seen == 1).all())  # every position on exactly one rank
    assert sorted(scored) == sorted(full.score_index.tolist())


def test_padded_split_of_one_row_by_hand():
    from dpo_megatron.data.batch import MicroBatch

    tokens = torch.arange(8).view(1, 8)
    batch = MicroBatch(tokens=tokens, labels=tokens + 100, position_ids=tokens.clone(),
                       loss_mask=torch.ones(1, 8), output_index=torch.tensor([1, 2, 6]),
                       score_index=torch.tensor([1, 2, 6]))
    rank1 = split_micro_batch(batch, 1, 2)
    assert rank1.tokens.tolist() == [[2, 3, 4, 5]]
    assert rank1.position_ids.tolist() == [[2, 3, 4, 5]]  # RoPE angles follow the chunks
    assert rank1.output_index.tolist() == [0] and rank1.score_index.tolist() == [2]
    rank0 = split_micro_batch(batch, 0, 2)
    assert rank0.tokens.tolist() == [[0, 1, 6, 7]]
    assert rank0.output_index.tolist() == [1, 2] and rank0.score_index.tolist() == [1, 6]


def test_packed_sequences_are_padded_to_whole_chunks():
    from dpo_megatron.data.packing import pack_pairs

    batch = pack_pairs(_pairs(), 0, 64, segment_multiple=4)
    for row in batch.segment_ids:
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        assert all(c % 4 == 0 for c in counts.tolist()), counts


BASE = ["data.tokenizer=t", "data.path=d.json"]


def test_world_size_counts_context_parallel_ranks():
    cfg = load_config(None, [*BASE, "parallel.context_parallel_size=2",
                             "parallel.tensor_model_parallel_size=2",
                             "parallel.data_parallel_size=2"])
    assert world_size_for(cfg) == 8
    assert cfg.parallel.sequence_granule() == 4


@pytest.mark.parametrize("overrides, match", [
    (["packing.enabled=true", "packing.row_length=1002"],
     r"packing.row_length=1002 .* multiple of 4 \(e.g. 1004\)"),
    (["packing.enabled=true", "packing.row_length=1004", "parallel.sequence_parallel=true",
      "parallel.tensor_model_parallel_size=2"],
     r"tensor_model_parallel_size=2 \(sequence parallelism\) = 8 .* multiple of 8 \(e.g. 1008\)"),
    (["model.local_attention=megatron"], "set model.local_attention=sdpa"),
    (["train.sample_during_eval=true"], "set train.sample_during_eval=false"),
    (["parallel.context_parallel_size=0"], r"context_parallel_size=0 must be >= 1"),
])
def test_context_parallel_config_errors_name_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [*BASE, "parallel.context_parallel_size=2", *overrides])


def test_world_size_not_divisible_names_context_parallel_size():
    from dpo_megatron.parallel import ParallelConfig

    with pytest.raises(ValueError, match=r"context_parallel_size \(2\) = 4"):
        ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2).validate(6)
