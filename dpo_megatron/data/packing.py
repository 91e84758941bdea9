"""Padding-free pair packing: several sequences per row, each attending only to itself.

A padded micro-batch of B pairs is 2B rows of the step's longest sequence; on real DPO data
(prompts of tens to thousands of tokens, chosen and rejected differing by hundreds) most of those
positions are padding. Packing places the 2B sequences of a micro-batch into as few rows of
``row_length`` tokens as first-fit-decreasing finds (Johnson 1973; the bin packing used by
Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination", arXiv:2107.02027).
Every sequence sees only itself: ``segment_ids`` give the attention a block-diagonal causal mask
(``models.attention``) and positions restart at 0, so each sequence's per-token log-probs are
those of the padded path.

Pairs are never split: a micro-batch is the same B pairs as in the padded path, only laid out
differently; ``output_index`` / ``score_index`` (``data.batch``) map each scored token between the
packed rows and the per-sequence layout (rows 0..B-1 chosen, B..2B-1 rejected), so losses,
metrics and precomputed reference log-probs never know whether a batch was packed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .batch import BatchBuilder, MicroBatch, StepBatch, round_up
from .collate import check_rows, pair_rows, reference_logps, score_mask
from .config import PackingConfig  # noqa: F401  (packing.* lives with the data configs: no torch)
from .pairs import PreferencePair


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices per row, each row's lengths summing to <= capacity.

    Sequences are taken longest first (ties: lower index first) and put in the first row with
    room. Example: lengths [5, 3, 4, 2], capacity 7 -> [[0, 3], [2, 1]].

    Raises:
        ValueError: a sequence longer than ``capacity``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens > packing row length "
                             f"{capacity} (raise packing.row_length or leave it 0)")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack_pairs(pairs: Sequence[PreferencePair], pad_token_id: int, row_length: int,
               num_rows: int = 0) -> MicroBatch:
    """Pack one micro-batch of B pairs into R rows of ``row_length`` tokens (see module doc).

    Args:
        pairs: the micro-batch (its 2B sequences are packed; none is cut).
        pad_token_id: fills the rows' unused tail.
        row_length: L, tokens per row.
        num_rows: R; 0 = as many as first-fit decreasing needs; more appends empty rows (so
            every micro-batch of a step has the same shape).

    Returns:
        A MicroBatch: tokens / labels / position_ids / segment_ids [R, L], loss_mask (and
        reference_logps when the pairs carry them) [2B, S] with S the longest sequence.

    Raises:
        ValueError: a sequence longer than ``row_length``, an empty prompt or completion, or
            ``num_rows`` smaller than the rows needed.
    """
    rows = pair_rows(pairs)
    check_rows(rows)
    lengths = [len(p) + len(c) for p, c in rows]
    plan = plan_rows(lengths, row_length)
    if num_rows and num_rows < len(plan):
        raise ValueError(f"micro-batch needs {len(plan)} packed rows, more than num_rows={num_rows}")
    n_rows = num_rows or len(plan)
    longest = max(lengths)
    tokens = torch.full((n_rows, row_length), pad_token_id, dtype=torch.int64)
    labels = torch.full((n_rows, row_length), pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros((n_rows, row_length), dtype=torch.int64)
    # Sequence j -> segment j; a row's unused tail -> a segment of its own (-1 - row), so that
    # every position attends to at least itself (no fully masked softmax rows).
    segment_ids = torch.empty((n_rows, row_length), dtype=torch.int32)
    start = [0] * len(rows)  # flat position of each sequence's first token in [R * L]
    for r in range(n_rows):
        segment_ids[r] = -1 - r
        offset = 0
        for j in (plan[r] if r < len(plan) else []):
            prompt, completion = rows[j]
            n = lengths[j]
            ids = torch.tensor([*prompt, *completion], dtype=torch.int64)
            tokens[r, offset:offset + n] = ids
            labels[r, offset:offset + n - 1] = ids[1:]
            position_ids[r, offset:offset + n] = torch.arange(n)
            segment_ids[r, offset:offset + n] = j
            start[j] = r * row_length + offset
            offset += n
        position_ids[r, offset:] = torch.arange(row_length - offset)
    loss_mask = score_mask(rows, longest)
    score_index = torch.nonzero(loss_mask.reshape(-1)).squeeze(1)
    seq, t = score_index // longest, score_index % longest
    output_index = torch.tensor(start, dtype=torch.int64)[seq] + t
    return MicroBatch(tokens=tokens, labels=labels, position_ids=position_ids,
                      loss_mask=loss_mask, output_index=output_index, score_index=score_index,
                      segment_ids=segment_ids, reference_logps=reference_logps(pairs, loss_mask))


def rows_needed(pairs: Sequence[PreferencePair], row_length: int) -> int:
    """Rows first-fit decreasing uses for this micro-batch's 2B sequences."""
    return len(plan_rows([len(p) + len(c) for p, c in pair_rows(pairs)], row_length))


def bucket_micro_batches(pairs: Sequence[PreferencePair],
                         micro_batch_indices: list[list[int]]) -> list[list[int]]:
    """Regroup a rank's step into micro-batches of similar pair length, longest pairs first.

    The micro-batch sizes and the set of pairs are kept; pairs are sorted by their longer
    sequence (ties: original order). Example: lengths [10, 90, 20, 80] in micro-batches of 2
    -> [[90, 80], [20, 10]] (by index: [[1, 3], [2, 0]]).
    """
    flat = [i for mb in micro_batch_indices for i in mb]
    key = {i: max(len(pairs[i].chosen_ids), len(pairs[i].rejected_ids)) + len(pairs[i].prompt_ids)
           for i in flat}
    ordered = sorted(flat, key=lambda i: -key[i])
    out, start = [], 0
    for mb in micro_batch_indices:
        out.append(ordered[start:start + len(mb)])
        start += len(mb)
    return out


class PackedPairs(BatchBuilder):
    """Packed pairs: every micro-batch of a step is R rows of L tokens, R the most rows any of
    its micro-batches needs, L ``packing.row_length`` (0: the step's longest sequence), rounded
    up to ``multiple``."""

    def __init__(self, pad_token_id: int, multiple: int, packing: PackingConfig):
        super().__init__(pad_token_id, multiple)
        self.packing = packing

    def micro_batch_indices(self, items, micro_batch_indices):
        if self.packing.bucket_by_length:
            return bucket_micro_batches(items, micro_batch_indices)
        return micro_batch_indices

    def build(self, items: Sequence[PreferencePair],
              micro_batch_indices: list[list[int]]) -> StepBatch:
        micro_batch_indices = self.micro_batch_indices(items, micro_batch_indices)
        step = [[items[i] for i in mb] for mb in micro_batch_indices]
        longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))
                      for mb in step for p in mb)
        length = round_up(self.packing.row_length or longest, self.multiple)
        n_rows = max(rows_needed(mb, length) for mb in step)
        micro_batches = []
        for mb, idx in zip(step, micro_batch_indices):
            batch = pack_pairs(mb, self.pad_token_id, length, n_rows)
            batch.item_indices = tuple(idx)
            micro_batches.append(batch)
        real_tokens = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)
                          for mb in step for p in mb)
        return StepBatch(micro_batches, length, real_tokens)
