"""The step-batch contract: what one micro-batch is, and the builder that makes a step's batches.

A micro-batch holds B whole items: B preference pairs as 2B sequences (rows 0..B-1
prompt+chosen, B..2B-1 prompt+rejected, so chosen and rejected of a pair always meet on the same
last-stage rank), or B SFT examples (prompt+completion, ``sequences_per_item=1``). The model
reads its rows in one of two layouts, and the loss always reads the per-sequence layout:

* **model layout** [R, L]: ``tokens``, ``labels``, ``position_ids`` and, for packed rows,
  ``segment_ids``. Padded: R = N sequences of L tokens, right padded. Packed: several sequences
  per row (``data.packing``), positions restarting at each one.
* **per-sequence layout** [N, S] (N = 2B or B, S = the longest sequence): ``loss_mask`` (1 where
  ``labels`` is a completion token) and ``reference_logps`` (precomputed reference per-token
  log-probs, when the pairs carry them).
* ``output_index`` [n] and ``score_index`` [n] join the two: the k-th scored token sits at flat
  position ``output_index[k]`` of the [R * L] model input and at ``score_index[k]`` of the
  [N * S] per-sequence layout. They are computed on the host, so the step never has to look at
  device values (``nonzero``) to know what to score.

Built on the host by one :class:`BatchBuilder` (padded, packed or SFT implementation), moved to
the device in one place (:meth:`StepBatch.to_device`), read by ``training.step``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch

from dpo_megatron.parallel.device import to_device


@dataclass
class MicroBatch:
    """One micro-batch (see the module docstring for the two layouts).

    Attributes:
        tokens: [R, L] int64 input ids.
        labels: [R, L] int64, the next token of each position (shifted inside each sequence).
        position_ids: [R, L] int64 positions (RoPE / learned), restarting at each packed sequence.
        loss_mask: [N, S] fp32, 1 where ``labels`` of that sequence position is a completion token.
        output_index: [n] int64 flat positions (``r * L + t``) of the scored tokens in the model
            layout, in per-sequence order (sequence 0's completion first).
        score_index: [n] int64 flat positions (``i * S + t``) of the same tokens in [N, S].
        segment_ids: [R, L] int32 sequence id of every position of a packed row (a row's unused
            tail has its own id); None for padded rows (one causal sequence per row).
        reference_logps: [N, S] fp32 reference log p(label) at the scored positions (0 elsewhere)
            when the items carry precomputed values; None when a reference pass must compute them.
        item_indices: dataset indices of the B items, in row order (host metadata).
        sequences_per_item: 2 for preference pairs, 1 for SFT examples.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    output_index: torch.Tensor
    score_index: torch.Tensor
    segment_ids: Optional[torch.Tensor] = None
    reference_logps: Optional[torch.Tensor] = None
    item_indices: tuple[int, ...] = ()
    sequences_per_item: int = 2

    @property
    def num_items(self) -> int:
        """B: pairs (or SFT examples) in the micro-batch."""
        return self.loss_mask.shape[0] // self.sequences_per_item

    @property
    def chosen_only(self) -> bool:
        """True for SFT micro-batches (one completion per item, no rejected rows)."""
        return self.sequences_per_item == 1

    def to_device(self) -> "MicroBatch":
        """The same micro-batch with every tensor on the engine's device."""
        moved = {f.name: to_device(getattr(self, f.name)) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


@dataclass
class StepBatch:
    """One data-parallel rank's micro-batches of one optimizer step.

    Attributes:
        micro_batches: in schedule order; all share R x L (the pipeline schedule sizes its
            p2p buffers once per call).
        seq_length: L, tokens per model row (a multiple of the padding granule).
        real_tokens: non-pad tokens of this rank's step, every sequence counted (a pair's prompt
            twice, as TRL counts it): the unit of the tokens/s metric.
    """

    micro_batches: list[MicroBatch]
    seq_length: int
    real_tokens: int

    @property
    def has_reference_logps(self) -> bool:
        """True when every micro-batch carries precomputed reference log-probs."""
        return all(mb.reference_logps is not None for mb in self.micro_batches)

    def to_device(self) -> "StepBatch":
        """The host -> device crossing of a step (the only one)."""
        return replace(self, micro_batches=[mb.to_device() for mb in self.micro_batches])


def round_up(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (tokens)."""
    return -(-length // multiple) * multiple


class BatchBuilder:
    """Items of one step -> a :class:`StepBatch` (host tensors). Implementations:
    ``data.collate.PaddedPairs``, ``data.collate.SFTExamples``, ``data.packing.PackedPairs``.

    Args:
        pad_token_id: fills padding positions (never scored).
        multiple: padding granule of the step's row length (tokens; includes TP under sequence
            parallelism, which splits rows along the sequence).
    """

    sequences_per_item = 2

    def __init__(self, pad_token_id: int, multiple: int):
        self.pad_token_id = pad_token_id
        self.multiple = multiple

    def build(self, items: Sequence, micro_batch_indices: list[list[int]]) -> StepBatch:
        """This rank's micro-batches of one step.

        Args:
            items: the whole (train or eval) list of pairs or examples.
            micro_batch_indices: indices into ``items``, one list per micro-batch
                (``PairSampler.next_step()``).
        """
        raise NotImplementedError

    def micro_batch_indices(self, items: Sequence,
                            micro_batch_indices: list[list[int]]) -> list[list[int]]:
        """The grouping the builder actually uses (bucketing may regroup)."""
        return micro_batch_indices


def make_batch_builder(pad_token_id: int, multiple: int, packing=None,
                       sft: bool = False, context_parallel: tuple[int, int] = (0, 1)
                       ) -> BatchBuilder:
    """The builder for a run: SFT examples (padded, chosen only), packed pairs
    (``packing.enabled``) or padded pairs; with ``context_parallel`` = (CP rank, CP size) and a
    size > 1, its micro-batches are cut for that rank (``data.context_split``) and packed
    sequences are padded to a multiple of 2 x CP. ``multiple`` must then be a multiple of 2 x CP.

    Raises:
        ValueError: packing asked for SFT examples (packing packs preference pairs).
    """
    from dpo_megatron.data.collate import PaddedPairs, SFTExamples
    from dpo_megatron.data.context_split import ContextParallelSplit
    from dpo_megatron.data.packing import PackedPairs

    rank, size = context_parallel
    packed = packing is not None and packing.enabled
    if sft:
        if packed:
            raise ValueError("packing.enabled=true packs preference pairs; an SFT loss trains "
                             "on single completions: set packing.enabled=false")
        builder = SFTExamples(pad_token_id, multiple)
    elif packed:
        builder = PackedPairs(pad_token_id, multiple, packing,
                              segment_multiple=2 * size if size > 1 else 1)
    else:
        builder = PaddedPairs(pad_token_id, multiple)
    return ContextParallelSplit(builder, rank, size) if size > 1 else builder
