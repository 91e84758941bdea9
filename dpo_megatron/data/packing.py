"""Padding-free pair packing: several sequences per row, a block-diagonal causal mask, per-sequence
positions, and the index that maps packed per-token values back to the padded [2B, S] layout.

A padded micro-batch of B pairs is 2B rows of the step's longest sequence; on real DPO data
(prompts of tens to thousands of tokens, chosen and rejected differing by hundreds) most of those
positions are padding. Packing places the 2B sequences of a micro-batch into as few rows of
``row_length`` tokens as first-fit-decreasing finds (Johnson 1973; the bin packing used by
Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination", arXiv:2107.02027).
Every sequence sees only itself: the attention mask is block-diagonal causal and its positions
restart at 0, so each sequence's per-token log-probs are those of the padded path.

Pairs are never split: a micro-batch is the same B pairs as in the padded path, only laid out
differently, and ``unpack_index`` gathers the packed values back into the padded layout (rows
0..B-1 chosen, B..2B-1 rejected) before the loss sees them. Losses, metrics and precomputed
reference log-probs therefore never know whether a batch was packed.

Packed micro-batch (all of a step share R and L so pipeline p2p buffers keep one shape):

* ``tokens``, ``labels``, ``position_ids``: [R, L] int64 (labels shifted inside each sequence);
* ``attention_mask``: [R, 1, L, L] bool, True = masked (megatron-core's local attention);
* ``unpack_index``: [2B, S] int64 into the flattened [R * L] packed tokens (0 where padding);
* ``loss_mask``: [2B, S] fp32 in the padded layout, equal to ``collate_pairs``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .pairs import PreferencePair


@dataclass
class PackingConfig:
    """Padding-free packing of each micro-batch's sequences (``packing.*``)."""

    enabled: bool = False
    """Pack the 2B sequences of each micro-batch into rows with a block-diagonal causal mask
    (local layer spec). Log-probs equal the padded path's (fp32, 1e-6)."""
    row_length: int = 0
    """Tokens per packed row (0: the step's longest sequence, rounded up to the padding granule,
    so attention costs per token stay those of the padded path). Must be >= the longest
    sequence."""
    bucket_by_length: bool = False
    """Within each data-parallel rank's share of a step, regroup pairs into micro-batches of
    similar length (longest first). The step's pair set, hence its loss and gradient, is
    unchanged; only which pairs share a micro-batch (and the per-pair report order) changes."""


def sequence_rows(pairs: Sequence[PreferencePair]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """B pairs -> 2B (prompt, completion) rows: chosen rows first, then rejected (collate order)."""
    return ([(p.prompt_ids, p.chosen_ids) for p in pairs]
            + [(p.prompt_ids, p.rejected_ids) for p in pairs])


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
               num_rows: int = 0) -> dict[str, torch.Tensor]:
    """Pack one micro-batch of B pairs into R rows of ``row_length`` tokens (see module doc).

    Args:
        pairs: the micro-batch (its 2B sequences are packed; none is cut).
        pad_token_id: fills the rows' unused tail.
        row_length: L, tokens per row.
        num_rows: R; 0 = as many as first-fit decreasing needs; more appends empty rows (so
            every micro-batch of a step has the same shape).

    Returns:
        tokens / labels / position_ids [R, L] int64, attention_mask [R, 1, L, L] bool,
        unpack_index [2B, S] int64 and loss_mask [2B, S] fp32 with S the longest sequence.

    Raises:
        ValueError: a sequence longer than ``row_length``, an empty prompt or completion, or
            ``num_rows`` smaller than the rows needed.
    """
    rows = sequence_rows(pairs)
    lengths = [len(p) + len(c) for p, c in rows]
    for i, (p, c) in enumerate(rows):
        if not p or not c:
            raise ValueError(f"sequence {i} has an empty prompt ({len(p)}) or completion ({len(c)})")
    plan = plan_rows(lengths, row_length)
    if num_rows and num_rows < len(plan):
        raise ValueError(f"micro-batch needs {len(plan)} packed rows, more than num_rows={num_rows}")
    n_rows = num_rows or len(plan)
    longest = max(lengths)
    tokens = torch.full((n_rows, row_length), pad_token_id, dtype=torch.int64)
    labels = torch.full((n_rows, row_length), pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros((n_rows, row_length), dtype=torch.int64)
    # Segment id per position: sequence j -> j, a row's unused tail -> its own segment (-1 - row)
    # so that every position attends to at least itself (no fully masked softmax rows).
    segment = torch.empty((n_rows, row_length), dtype=torch.int64)
    unpack_index = torch.zeros((len(rows), longest), dtype=torch.int64)
    loss_mask = torch.zeros((len(rows), longest), dtype=torch.float32)
    for r in range(n_rows):
        segment[r] = -1 - r
        offset = 0
        for j in (plan[r] if r < len(plan) else []):
            prompt, completion = rows[j]
            n = lengths[j]
            ids = torch.tensor([*prompt, *completion], dtype=torch.int64)
            tokens[r, offset:offset + n] = ids
            labels[r, offset:offset + n - 1] = ids[1:]
            position_ids[r, offset:offset + n] = torch.arange(n)
            segment[r, offset:offset + n] = j
            unpack_index[j, :n] = r * row_length + offset + torch.arange(n)
            # Same scoring rule as collate_rows: labels[t] is a completion token.
            loss_mask[j, len(prompt) - 1:n - 1] = 1.0
            offset += n
        tail = row_length - offset
        position_ids[r, offset:] = torch.arange(tail)
    causal = torch.ones(row_length, row_length, dtype=torch.bool).tril()
    visible = (segment[:, :, None] == segment[:, None, :]) & causal
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids,
            "attention_mask": (~visible).unsqueeze(1), "unpack_index": unpack_index,
            "loss_mask": loss_mask}


def unpack_token_values(packed: torch.Tensor, unpack_index: torch.Tensor) -> torch.Tensor:
    """Packed per-token values [R, L] -> padded layout [2B, S] (padding positions hold
    ``packed[0, 0]``; multiply by the loss mask). Differentiable (a gather)."""
    return packed.reshape(-1)[unpack_index]


def rows_needed(pairs: Sequence[PreferencePair], row_length: int) -> int:
    """Rows first-fit decreasing uses for this micro-batch's 2B sequences."""
    return len(plan_rows([len(p) + len(c) for p, c in sequence_rows(pairs)], row_length))


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


def build_packed_micro_batches(pairs: Sequence[PreferencePair], micro_batch_indices: list[list[int]],
                               pad_token_id: int, multiple: int, row_length: int = 0):
    """Packed counterpart of ``training.batches.build_micro_batches`` (same return contract).

    Args:
        pairs: the whole pair list; micro_batch_indices: this rank's micro-batches of the step.
        multiple: granule the row length is rounded up to (include TP for sequence parallel).
        row_length: tokens per row (0: the step's longest sequence, rounded up to ``multiple``).

    Returns:
        (micro_batches, row_length, real_tokens): ``pack_pairs`` dicts sharing R and L (R = the
        most rows any micro-batch of the step needs), L, and the step's non-pad token count.
    """
    step_pairs = [[pairs[i] for i in mb] for mb in micro_batch_indices]
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))
                  for mb in step_pairs for p in mb)
    length = row_length or longest
    length = -(-length // multiple) * multiple
    n_rows = max(rows_needed(mb, length) for mb in step_pairs)
    micro_batches = [pack_pairs(mb, pad_token_id, length, n_rows) for mb in step_pairs]
    real_tokens = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)
                      for mb in step_pairs for p in mb)
    return micro_batches, length, real_tokens
