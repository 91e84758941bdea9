"""The one owner of the context-parallel batch split: a micro-batch's model layout cut along the
sequence for one CP rank.

Every unit of a row (the whole row when padded; each packed unit, a sequence or a shared-prompt
pair, and the row's unused tail when packed, see ``data.packing``) is cut into 2 x CP equal
chunks and CP rank r keeps chunks r and 2CP-1-r of each (``parallel.context.chunk_positions``:
megatron-core's load-balanced layout, applied per unit as transformer-engine's THD format does).
The kept positions of a row are laid out unit by unit, so each rank's row is L / CP tokens.

What is cut and what is not:

* ``tokens``, ``position_ids`` [R, L] -> [R, L / CP]: gathered at the kept positions;
  ``packed`` becomes :class:`LocalRows` (the kept positions' segment and branch ids), which is
  all the context-parallel attention reads (``models.context_attention``). A scored token's
  label is its ``target_ids`` entry, so a chunk's last token still scores the next token when
  that token sits on another rank. ``position_ids`` travel with their tokens, so RoPE rotates
  every token by its position in its sequence (``models.gpt.ScoringGPTModel`` reads per-token
  positions; a shared pair's rejected positions keep continuing after the prompt).
* ``output_index`` / ``target_ids`` and the targets' ``score_index`` [n] -> [n_r]: only the
  scored tokens this rank holds, with ``output_index`` renumbered into the [R * L / CP] local
  layout; a padded row's ``padding_mask`` is cut as its tokens.
* the targets' ``loss_mask`` and ``reference_logps`` [N, S] (the per-sequence layout) are kept
  whole: each rank fills its tokens' log-probs into [N, S] and the CP group sums them
  (``training.step.token_logps``), so the loss sees every token of every sequence. (A reward
  model, whose targets score each sequence's last token, has no context-parallel form.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from dpo_megatron.data.batch import BatchBuilder, MicroBatch, StepBatch
from dpo_megatron.losses.targets import TokenTargets
from dpo_megatron.parallel.context import chunk_positions
from dpo_megatron.parallel.device import to_device


@dataclass
class LocalRows:
    """A CP rank's share of a packed layout (``data.batch.PackedLayout``), per local position.

    Attributes:
        segment_ids: [R, L / CP] int32 unit id of each kept position.
        branch_ids: [R, L / CP] int8 branch (0 prompt / plain / padding, 1 chosen, 2 rejected)
            with shared prompts, else None.
    """

    segment_ids: torch.Tensor
    branch_ids: torch.Tensor | None

    def to_device(self) -> LocalRows:
        """The same rows with their tensors on the engine's device."""
        return replace(
            self,
            **{
                f.name: to_device(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def _row_spans(segment_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of equal ids in one row [L]."""
    change = torch.nonzero(segment_ids[1:] != segment_ids[:-1]).squeeze(1) + 1
    starts = [0, *change.tolist()]
    ends = [*change.tolist(), segment_ids.shape[0]]
    return [(s, e - s) for s, e in zip(starts, ends)]


def local_positions(batch: MicroBatch, rank: int, size: int) -> torch.Tensor:
    """[R, L / CP] int64 positions of each row that CP rank ``rank`` of ``size`` holds.

    Raises:
        ValueError: a span (the row, or one packed sequence) whose length is not a multiple of
            2 x CP (the batch builders pad to it: ``train.seq_length_multiple`` is combined with
            ``parallel.sequence_granule()``, packing pads every sequence).
    """
    rows, length = batch.tokens.shape
    if batch.packed is None:
        return chunk_positions(length, rank, size).expand(rows, -1).contiguous()
    out = []
    for r in range(rows):
        try:
            out.append(
                torch.cat(
                    [
                        start + chunk_positions(n, rank, size)
                        for start, n in _row_spans(batch.packed.segment_ids[r])
                    ]
                )
            )
        except ValueError as err:
            raise ValueError(f"packed row {r}: {err}") from None
    return torch.stack(out)


def split_micro_batch(
    batch: MicroBatch, targets: TokenTargets, rank: int, size: int
) -> tuple[MicroBatch, TokenTargets]:
    """This CP rank's share of ``batch`` and of its ``targets`` (their ``score_index``: see the
    module docstring). Identity for ``size`` 1."""
    if size == 1:
        return batch, targets
    rows, length = batch.tokens.shape
    keep = local_positions(batch, rank, size)  # [R, L / CP]
    local_length = keep.shape[1]
    # Flat model position r * L + t -> its local flat index, or -1 on another rank.
    local_index = torch.full((rows * length,), -1, dtype=torch.int64)
    flat_keep = (torch.arange(rows)[:, None] * length + keep).reshape(-1)
    local_index[flat_keep] = torch.arange(rows * local_length)
    mapped = local_index[batch.output_index]
    held = mapped >= 0

    def cut(t):
        return None if t is None else t.gather(1, keep)

    packed = (
        None
        if batch.packed is None
        else LocalRows(cut(batch.packed.segment_ids), cut(batch.packed.branch_ids))
    )
    inputs = replace(
        batch,
        tokens=cut(batch.tokens),
        position_ids=cut(batch.position_ids),
        packed=packed,
        padding_mask=cut(batch.padding_mask),
        output_index=mapped[held],
        target_ids=batch.target_ids[held],
    )
    return inputs, replace(targets, score_index=targets.score_index[held])


class ContextParallelSplit(BatchBuilder):
    """A batch builder whose micro-batches are cut for one CP rank (wraps the padded, packed or
    SFT builder; the step's ``seq_length`` stays the full L, which megatron-core's schedule
    divides by CP itself when it sizes its pipeline buffers)."""

    def __init__(self, inner: BatchBuilder, rank: int, size: int):
        super().__init__(inner.pad_token_id, inner.multiple, inner.kind)
        self.inner, self.rank, self.size = inner, rank, size
        self.sequences_per_item = inner.sequences_per_item

    def micro_batch_indices(self, items, micro_batch_indices):
        return self.inner.micro_batch_indices(items, micro_batch_indices)

    def build(self, items: Sequence, micro_batch_indices: list[list[int]]) -> StepBatch:
        step = self.inner.build(items, micro_batch_indices)
        split = [
            split_micro_batch(mb, targets, self.rank, self.size)
            for mb, targets in zip(step.micro_batches, step.targets)
        ]
        return replace(
            step,
            micro_batches=[inputs for inputs, _ in split],
            targets=[targets for _, targets in split],
        )
