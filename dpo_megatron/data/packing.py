"""Padding-free pair packing: several sequences per row, each attending only to itself, and
shared-prompt pairs that run their prompt once.

A padded micro-batch of B pairs is 2B rows of the step's longest sequence; on real DPO data
(prompts of tens to thousands of tokens, chosen and rejected differing by hundreds) most of those
positions are padding. Packing places whole *units* into rows by first-fit decreasing (Johnson
1973; the bin packing of Krell et al. 2021, "Efficient Sequence Packing without
Cross-contamination", arXiv:2107.02027). By default (``packing.row_length=0``) a micro-batch is
one row holding all its units back to back (the THD form of transformer-engine and varlen
kernels), so only the rounding to the padding granule is padding.

* :class:`PackedPairs`: a unit is one sequence (prompt + completion); the 2B sequences of a
  micro-batch each see only themselves, positions restart at 0.
* :class:`SharedPromptPairs` (``packing.share_prompt``): a unit is one pair as
  ``[prompt | chosen | rejected]``, so every linear layer and the MLP see the prompt once. The
  chosen tokens attend to the prompt and the earlier chosen tokens, the rejected tokens to the
  prompt and the earlier rejected tokens (never the chosen ones), and the rejected positions
  continue from the end of the prompt: each completion computes exactly what it computes after
  its own copy of the prompt. The last prompt position scores the first token of both
  completions. (Prefix sharing: Wang et al. 2024, "Accelerating Direct Preference Optimization
  with Prefix Sharing", arXiv:2410.20305.)

The layout of a row is a :class:`~dpo_megatron.data.batch.PackedLayout` (segment and branch ids
per position, and the attention spans); ``models.attention`` turns it into whatever its kernel
needs. Pairs are never split: a micro-batch is the same B pairs as in the padded path, only laid
out differently; ``output_index`` / ``score_index`` / ``target_ids`` (``data.batch``) map each
scored token between the packed rows and the per-sequence layout (rows 0..B-1 chosen, B..2B-1
rejected), so losses, metrics and precomputed reference log-probs never know how a batch was
packed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dpo_megatron.data.batch import (
    SIDES,
    AttentionSpan,
    BatchBuilder,
    MicroBatch,
    PackedLayout,
    StepBatch,
    padding_spans,
    round_up,
)
from dpo_megatron.data.collate import (
    check_rows,
    pair_rows,
    reward_position,
    score_mask,
    score_targets,
)
from dpo_megatron.data.config import PackingConfig  # noqa: F401  (packing.* lives with the data configs: no torch)
from dpo_megatron.data.pairs import PreferencePair
from dpo_megatron.data.targets import target_maker
from dpo_megatron.losses.targets import Targets


@dataclass
class PackedUnit:
    """One unit placed whole in a packed row (a sequence, or a shared-prompt pair).

    Attributes:
        tokens: input ids, in row order.
        position_ids: RoPE / learned positions of ``tokens``.
        branch_ids: 0 (shared / plain), 1 (chosen), 2 (rejected) per token.
        spans: attention spans relative to the unit's first position.
        sequences: (index in the per-sequence layout, unit-local position of each of its
            tokens) for each sequence the unit carries.
    """

    tokens: list[int]
    position_ids: list[int]
    branch_ids: list[int]
    spans: list[AttentionSpan]
    sequences: list[tuple[int, list[int]]]

    def __len__(self) -> int:
        return len(self.tokens)


def sequence_unit(index: int, prompt: Sequence[int], completion: Sequence[int]) -> PackedUnit:
    """Sequence ``index`` (prompt + completion) as a unit attending to itself."""
    n = len(prompt) + len(completion)
    return PackedUnit(
        tokens=[*prompt, *completion],
        position_ids=list(range(n)),
        branch_ids=[0] * n,
        spans=[AttentionSpan(0, n, ((0, n),))],
        sequences=[(index, list(range(n)))],
    )


def shared_prompt_unit(index: int, num_pairs: int, pair: PreferencePair) -> PackedUnit:
    """Pair ``index`` of ``num_pairs`` as ``[prompt | chosen | rejected]``: sequences ``index``
    (chosen) and ``num_pairs + index`` (rejected) of the per-sequence layout.

    Positions: prompt 0..p-1, chosen p..p+c-1, rejected p..p+r-1. Spans: ``[prompt | chosen]``
    causal on itself; ``rejected`` on ``[prompt ; rejected]`` (bottom-right causal).
    Example: p=2, c=2, r=3 -> positions [0, 1, 2, 3, 2, 3, 4], branches [0, 0, 1, 1, 2, 2, 2].
    """
    prompt, chosen, rejected = pair.prompt_ids, pair.chosen_ids, pair.rejected_ids
    p, c, r = len(prompt), len(chosen), len(rejected)
    return PackedUnit(
        tokens=[*prompt, *chosen, *rejected],
        position_ids=[*range(p + c), *range(p, p + r)],
        branch_ids=[0] * p + [1] * c + [2] * r,
        spans=[
            AttentionSpan(0, p + c, ((0, p + c),)),
            AttentionSpan(p + c, p + c + r, ((0, p), (p + c, p + c + r))),
        ],
        sequences=[
            (index, list(range(p + c))),
            (num_pairs + index, [*range(p), *range(p + c, p + c + r)]),
        ],
    )


def pad_unit(unit: PackedUnit, multiple: int, pad_token_id: int) -> PackedUnit:
    """``unit`` padded inside itself to a multiple of ``multiple`` tokens (2 x CP under context
    parallelism, so that each unit cuts into 2 x CP equal chunks, ``data.context_split``).

    The pad tokens are unscored, branch 0, with positions after the unit's last one (so causal
    attention by position hides them from every real token) and a padding span of their own.
    Example: a 5-token sequence at multiple 4 gains 3 pad tokens at positions 5, 6, 7.
    """
    n = len(unit)
    extra = round_up(n, multiple) - n
    if extra == 0:
        return unit
    first = max(unit.position_ids) + 1
    return PackedUnit(
        tokens=[*unit.tokens, *[pad_token_id] * extra],
        position_ids=[*unit.position_ids, *range(first, first + extra)],
        branch_ids=[*unit.branch_ids, *[0] * extra],
        spans=[*unit.spans, AttentionSpan(n, n + extra, ((n, n + extra),), padding=True)],
        sequences=unit.sequences,
    )


def pair_units(pairs: Sequence[PreferencePair]) -> list[PackedUnit]:
    """The 2B sequences of a micro-batch as units (chosen rows first, then rejected)."""
    rows = pair_rows(pairs)
    check_rows(rows)
    return [sequence_unit(j, p, c) for j, (p, c) in enumerate(rows)]


def shared_prompt_units(pairs: Sequence[PreferencePair]) -> list[PackedUnit]:
    """The B pairs of a micro-batch as ``[prompt | chosen | rejected]`` units."""
    check_rows(pair_rows(pairs))
    return [shared_prompt_unit(i, len(pairs), p) for i, p in enumerate(pairs)]


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: unit indices per row, each row's lengths summing to <= capacity.

    Units are taken longest first (ties: lower index first) and put in the first row with
    room. Example: lengths [5, 3, 4, 2], capacity 7 -> [[0, 3], [2, 1]].

    Raises:
        ValueError: a unit longer than ``capacity``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(
                f"packed unit {i} has {lengths[i]} tokens > packing row length "
                f"{capacity} (raise packing.row_length or leave it 0)"
            )
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack_units(
    units: Sequence[PackedUnit],
    pairs: Sequence[PreferencePair],
    pad_token_id: int,
    row_length: int,
    num_rows: int = 0,
    kind: str = "pairs",
) -> tuple[MicroBatch, Targets]:
    """Place one micro-batch's units into R rows of ``row_length`` tokens (first-fit
    decreasing) and map its scored tokens (see the module docstring).

    Args:
        units: the micro-batch's units (none is cut).
        pairs: its B pairs (per-sequence layout, precomputed reference log-probs).
        pad_token_id: fills the rows' unused tail.
        row_length: L, tokens per row.
        num_rows: R; 0 = as many as first-fit decreasing needs; more appends empty rows (so
            every micro-batch of a step has the same shape).
        kind: the item kind whose targets are made (``data.targets``).

    Returns:
        (the MicroBatch: tokens / position_ids [R, L] with their :class:`PackedLayout`; its
        targets: loss_mask, and reference_logps when the pairs carry them, [2B, S], S the
        longest sequence).

    Raises:
        ValueError: a unit longer than ``row_length``, or ``num_rows`` smaller than the rows
            needed.
    """
    plan = plan_rows([len(u) for u in units], row_length)
    if num_rows and num_rows < len(plan):
        raise ValueError(
            f"micro-batch needs {len(plan)} packed rows, more than num_rows={num_rows}"
        )
    n_rows = num_rows or len(plan)
    tokens = torch.full((n_rows, row_length), pad_token_id, dtype=torch.int64)
    position_ids = torch.zeros((n_rows, row_length), dtype=torch.int64)
    branch_ids = torch.zeros((n_rows, row_length), dtype=torch.int8)
    # Unit j -> segment j; a row's unused tail -> a segment of its own (-1 - row), so that
    # every position attends to at least itself (no fully masked softmax rows).
    segment_ids = torch.empty((n_rows, row_length), dtype=torch.int32)
    spans: list[AttentionSpan] = []
    starts = [0] * len(units)  # flat position of each unit's first token in [R * L]
    for r in range(n_rows):
        segment_ids[r] = -1 - r
        offset = 0
        for j in plan[r] if r < len(plan) else []:
            unit, n, base = units[j], len(units[j]), r * row_length + offset
            tokens[r, offset : offset + n] = torch.tensor(unit.tokens)
            position_ids[r, offset : offset + n] = torch.tensor(unit.position_ids)
            branch_ids[r, offset : offset + n] = torch.tensor(unit.branch_ids, dtype=torch.int8)
            segment_ids[r, offset : offset + n] = j
            spans += [
                AttentionSpan(
                    base + s.q_start, base + s.q_end, tuple((base + b, base + e) for b, e in s.keys)
                )
                for s in unit.spans
            ]
            starts[j] = base
            offset += n
        position_ids[r, offset:] = torch.arange(row_length - offset)
        spans += padding_spans(r * row_length + offset, (r + 1) * row_length)
    rows = pair_rows(pairs)
    longest = max(len(p) + len(c) for p, c in rows)
    loss_mask = score_mask(rows, longest)
    # A sequence no unit carries (BatchBuilder.computing) keeps its row, with nothing scored.
    carried = {i for unit in units for i, _ in unit.sequences}
    computed = [i in carried for i in range(len(rows))]
    loss_mask[[i for i, keep in enumerate(computed) if not keep]] = 0.0
    score_index, target_ids = score_targets(rows, loss_mask)
    # Model position of token t of sequence i: its unit's start + the unit-local position.
    where = torch.zeros((len(rows), longest), dtype=torch.int64)
    for j, unit in enumerate(units):
        for i, local in unit.sequences:
            where[i, : len(local)] = starts[j] + torch.tensor(local)
    output_index = where.reshape(-1)[score_index]
    last_index = torch.stack(
        [where[i, reward_position(p, c, pad_token_id)] for i, (p, c) in enumerate(rows)]
    )
    shared = any(b != 0 for u in units for b in u.branch_ids)
    layout = PackedLayout.from_spans(segment_ids, branch_ids if shared else None, spans)
    targets = target_maker(kind)(pairs, loss_mask, score_index, last_index, computed)
    output_index, target_ids = targets.model_scores(output_index, target_ids)
    inputs = MicroBatch(
        tokens=tokens,
        position_ids=position_ids,
        output_index=output_index,
        target_ids=target_ids,
        num_items=targets.num_items,
        packed=layout,
    )
    return inputs, targets


def pack_pairs(
    pairs: Sequence[PreferencePair], pad_token_id: int, row_length: int, num_rows: int = 0
) -> tuple[MicroBatch, Targets]:
    """Pack one micro-batch of B pairs as 2B sequences into R rows of ``row_length`` tokens
    (:func:`pack_units`).

    Raises:
        ValueError: a sequence longer than ``row_length``, an empty prompt or completion, or
            ``num_rows`` smaller than the rows needed.
    """
    return pack_units(pair_units(pairs), pairs, pad_token_id, row_length, num_rows)


def pack_shared_prompt_pairs(
    pairs: Sequence[PreferencePair], pad_token_id: int, row_length: int, num_rows: int = 0
) -> tuple[MicroBatch, Targets]:
    """Pack one micro-batch of B pairs as B ``[prompt | chosen | rejected]`` units
    (:func:`pack_units`); same per-sequence layout as :func:`pack_pairs`.

    Raises:
        ValueError: a pair longer than ``row_length``, an empty prompt or completion, or
            ``num_rows`` smaller than the rows needed.
    """
    return pack_units(shared_prompt_units(pairs), pairs, pad_token_id, row_length, num_rows)


def sequence_pair_length(pair: PreferencePair) -> int:
    """A pair's longer sequence (prompt + the longer completion), in tokens."""
    return len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))


def shared_pair_length(pair: PreferencePair) -> int:
    """A pair's ``[prompt | chosen | rejected]`` unit, in tokens."""
    return len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)


def bucket_micro_batches(
    pairs: Sequence[PreferencePair],
    micro_batch_indices: list[list[int]],
    key: Callable[[PreferencePair], int] = sequence_pair_length,
) -> list[list[int]]:
    """Regroup a rank's step into micro-batches of similar pair length, longest pairs first.

    The micro-batch sizes and the set of pairs are kept; pairs are sorted by ``key`` (default:
    their longer sequence; ties: original order). Example: lengths [10, 90, 20, 80] in
    micro-batches of 2 -> [[90, 80], [20, 10]] (by index: [[1, 3], [2, 0]]).
    """
    flat = [i for mb in micro_batch_indices for i in mb]
    length = {i: key(pairs[i]) for i in flat}
    ordered = sorted(flat, key=lambda i: -length[i])
    out, start = [], 0
    for mb in micro_batch_indices:
        out.append(ordered[start : start + len(mb)])
        start += len(mb)
    return out


class PackedPairs(BatchBuilder):
    """Packed pairs: every micro-batch of a step is R rows of L tokens. ``packing.row_length``
    0: R = 1, L the step's longest micro-batch (all its units); else L = ``row_length`` and R the
    most rows any micro-batch needs. L is rounded up to ``multiple``."""

    units = staticmethod(pair_units)
    """Micro-batch of pairs -> its packed units."""
    pair_length = staticmethod(sequence_pair_length)
    """Length key of a pair for bucketing."""

    sides = SIDES
    """The sequences its micro-batches compute (:meth:`computing`)."""
    statistic_sides: tuple[str, ...] | None = None
    """The sequences of the attached step-statistic micro-batches, or None (none attached)."""

    def __init__(
        self,
        pad_token_id: int,
        multiple: int,
        packing: PackingConfig,
        unit_multiple: int = 1,
        kind: str = "pairs",
    ):
        super().__init__(pad_token_id, multiple, kind)
        self.packing = packing
        self.unit_multiple = unit_multiple
        """Each unit is padded to a multiple of this (:func:`pad_unit`; 2 x CP under CP)."""

    def computing(self, sides=SIDES, statistic_sides=None) -> BatchBuilder:
        """A copy computing ``sides`` and attaching ``statistic_sides``
        (:meth:`BatchBuilder.computing`); each sequence is its own unit, so any side can go."""
        unknown = (set(sides) | set(statistic_sides or ())) - set(SIDES)
        if unknown:
            raise ValueError(f"unknown sides {sorted(unknown)}; known: {SIDES}")
        builder = copy.copy(self)
        builder.sides = tuple(sides)
        builder.statistic_sides = None if statistic_sides is None else tuple(statistic_sides)
        return builder

    def micro_batch_indices(self, items, micro_batch_indices):
        if self.packing.bucket_by_length:
            return bucket_micro_batches(items, micro_batch_indices, self.pair_length)
        return micro_batch_indices

    def build(
        self, items: Sequence[PreferencePair], micro_batch_indices: list[list[int]]
    ) -> StepBatch:
        micro_batch_indices = self.micro_batch_indices(items, micro_batch_indices)
        batch = self._build(items, micro_batch_indices, self.sides)
        if self.statistic_sides is not None:
            statistic = self._build(items, micro_batch_indices, self.statistic_sides)
            batch.statistic = statistic
            batch.real_tokens += statistic.real_tokens
            batch.model_tokens += statistic.model_tokens
        return batch

    def _units(self, pairs: Sequence[PreferencePair], sides) -> list[PackedUnit]:
        """The units of one micro-batch's pairs that carry a sequence of ``sides`` (all of them
        with both sides)."""
        units = self.units(pairs)
        if tuple(sides) == SIDES:
            return units
        side_of = [SIDES[i >= len(pairs)] for i in range(2 * len(pairs))]
        return [u for u in units if all(side_of[i] in sides for i, _ in u.sequences)]

    def _build(self, items, micro_batch_indices: list[list[int]], sides) -> StepBatch:
        step = [[items[i] for i in mb] for mb in micro_batch_indices]
        raw = [self._units(mb, sides) for mb in step]
        units = [[pad_unit(u, self.unit_multiple, self.pad_token_id) for u in us] for us in raw]
        if self.packing.row_length:
            length = round_up(self.packing.row_length, self.multiple)
            n_rows = max(len(plan_rows([len(u) for u in us], length)) for us in units)
        else:
            length = round_up(max(sum(len(u) for u in us) for us in units), self.multiple)
            n_rows = 1
        built = [
            pack_units(us, mb, self.pad_token_id, length, n_rows, self.kind)
            for mb, us in zip(step, units)
        ]
        real_tokens = sum(
            len(p.prompt_ids) + len(p.chosen_ids if side == "chosen" else p.rejected_ids)
            for mb in step
            for p in mb
            for side in sides
        )
        model_tokens = sum(len(u) for us in raw for u in us)  # without the 2 x CP padding
        return StepBatch(
            [inputs for inputs, _ in built],
            [targets for _, targets in built],
            length,
            real_tokens,
            model_tokens,
            item_indices=[tuple(idx) for idx in micro_batch_indices],
        )


class SharedPromptPairs(PackedPairs):
    """Shared-prompt pairs (``packing.share_prompt``): as :class:`PackedPairs`, with one
    ``[prompt | chosen | rejected]`` unit per pair; ``model_tokens`` counts each prompt once."""

    units = staticmethod(shared_prompt_units)
    pair_length = staticmethod(shared_pair_length)

    def computing(self, sides=SIDES, statistic_sides=None) -> BatchBuilder:
        """Itself: a ``[prompt | chosen | rejected]`` unit computes both sides."""
        return self
