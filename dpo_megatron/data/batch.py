"""The step-batch contract: what one micro-batch is, and the builder that makes a step's batches.

A micro-batch holds B whole items of one kind (``data.kinds``): B preference pairs as 2B
sequences (rows 0..B-1 prompt+chosen, B..2B-1 prompt+rejected, so chosen and rejected of a pair
always meet on the same last-stage rank), B unpaired examples as 2B sequences (each completion,
then each KL completion), or B SFT examples (prompt+completion). A :class:`MicroBatch` holds
only what the model reads, in the model layout; the item kind's targets (``losses.targets``),
which the loss reads in the per-sequence layout, travel beside it (:attr:`StepBatch.targets`,
one per micro-batch):

* **model layout** [R, L]: ``tokens``, ``position_ids`` and, for packed rows, their
  :class:`PackedLayout` (``packed``). Padded: R = N sequences of L tokens, right padded. Packed:
  several sequences per row (``data.packing``), positions restarting at each one; with
  ``packing.share_prompt`` one segment ``[prompt | chosen | rejected]`` per pair, so one model
  position (the last prompt token) scores the first token of both completions.
* **per-sequence layout** [N, S] (N = 2B or B, S = the longest sequence): the targets'
  ``loss_mask`` (1 where a position's next token is a completion token) and, when the items
  carry them, ``reference_logps`` (precomputed reference per-token log-probs).
* ``output_index`` [n] and the targets' ``score_index`` [n] join the two: the k-th scored token
  sits at flat position ``output_index[k]`` of the [R * L] model input and at ``score_index[k]``
  of the [N * S] per-sequence layout, and ``target_ids[k]`` is its label. They are computed on
  the host, so the step never has to look at device values (``nonzero``) to know what to score.
  An ``output_index`` value may repeat (a shared prompt's last position scores two sequences).
  A reward model's micro-batch scores one position per sequence instead (``RewardTargets``).

Built on the host by one :class:`BatchBuilder` (padded, packed or SFT implementation; the kind's
targets by ``data.targets``), moved to the device in one place (:meth:`StepBatch.to_device`), read
by ``training.step``: the model gets each :class:`MicroBatch`, the loss its targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import torch

from dpo_megatron.losses.targets import Targets
from dpo_megatron.parallel.device import to_device


class AttentionSpan(NamedTuple):
    """One causal attention problem of packed rows, in flat positions ``r * L + t`` of [R, L].

    Queries ``q_start .. q_end - 1`` attend to the keys at the positions of ``keys`` (ranges,
    concatenated in order), causally aligned at the bottom right: with Q queries and K keys,
    query i sees keys 0 .. K - Q + i (flash-attention's varlen convention). A plain sequence is
    one span whose keys are its queries (square, ordinary causal). A shared-prompt pair is two:
    ``[prompt | chosen]`` on itself, and ``rejected`` on ``[prompt ; rejected]`` (never chosen).
    """

    q_start: int
    q_end: int
    keys: tuple[tuple[int, int], ...]
    padding: bool = False
    """A row's unused tail (it attends causally to itself; nothing reads its outputs)."""


PADDING_SPAN = 128
"""Most positions in one padding span (:func:`padding_spans`)."""


def padding_spans(start: int, end: int) -> list[AttentionSpan]:
    """Flat positions ``start .. end - 1`` that nothing reads (a row's unused tail), as padding
    spans of at most :data:`PADDING_SPAN` positions, each attending causally to itself.

    A varlen kernel (flash-attention's, transformer-engine's THD) computes every span it is
    given: a tail of n positions as one span would cost it as much attention as a sequence of n
    tokens (n^2 / 2), in pieces it costs at most n * PADDING_SPAN / 2.
    Example: ``padding_spans(10, 300)`` -> spans [10, 138), [138, 266), [266, 300).
    """
    return [
        AttentionSpan(
            a, min(a + PADDING_SPAN, end), ((a, min(a + PADDING_SPAN, end)),), padding=True
        )
        for a in range(start, end, PADDING_SPAN)
    ]


@dataclass
class SpanRows:
    """The spans of packed rows as N square causal rows: SDPA with ``is_causal`` computes every
    span with no mask, one call per bucket of rows of similar width (:func:`span_rows`).

    Row n holds the n-th non-padding span: its K keys in slots 0..K-1 and its Q queries in the
    last Q of them (K-Q..K-1), so top-left causal attention over the row is the span's
    bottom-right rule (query i sees keys 0..K-Q+i). Slots before the queries hold filler queries
    (the span's first query again: a shared-prompt rejected row recomputes its prompt's queries,
    as an unshared row would) and slots after K filler keys and queries (causality hides filler
    keys from every real query); nothing reads the fillers' outputs, so they get no gradient.

    A bucket is run at its own width W_b (its widest span's K), its rows cut to their first W_b
    slots: a span costs about W_b^2 instead of the widest span's W^2 (SmolLM2's DPO pairs of up
    to 512 tokens, 4 a step: 1.3-2x less attention than one call at W).

    Attributes:
        query_index: [N, W] int64 position in the query tensor of each slot's query.
        key_index: [N, W] int64 position in the key / value tensors of each slot's key.
        output_index: [Tq] int64 position of query position t's output in the buckets' outputs
            laid end to end (bucket b's rows in order, ``W_b`` slots each); a padding span's
            positions point at position 0 (nothing reads them).
        buckets: (rows [N_b] int64, W_b) per bucket, widest first; every row in one bucket.
    """

    query_index: torch.Tensor
    key_index: torch.Tensor
    output_index: torch.Tensor
    buckets: tuple[tuple[torch.Tensor, int], ...] = ()

    def to_device(self) -> SpanRows:
        """The same rows with their tensors on the engine's device."""
        return SpanRows(
            to_device(self.query_index),
            to_device(self.key_index),
            to_device(self.output_index),
            tuple((to_device(rows), width) for rows, width in self.buckets),
        )


def row_buckets(widths: Sequence[int]) -> list[list[int]]:
    """Rows grouped by width, widest first: a row joins the bucket of the widest rows left if it
    is at least 3/4 as wide (so no row pays more than (4/3)^2 its own attention), rows in row
    order within a bucket. Example: widths [4, 5, 3, 3] -> [[0, 1], [2, 3]]."""
    order = sorted(range(len(widths)), key=lambda n: -widths[n])
    buckets: list[list[int]] = []
    for n in order:
        if buckets and 4 * widths[n] >= 3 * widths[buckets[-1][0]]:
            buckets[-1].append(n)
        else:
            buckets.append([n])
    return [sorted(b) for b in buckets]


def span_rows(spans: Sequence[AttentionSpan]) -> SpanRows:
    """:class:`SpanRows` of ``spans`` (their queries tiling 0..Tq-1 in order; host tensors).

    Example: spans [0, 4) on keys [0, 4) and [4, 7) on keys [0, 2) ++ [4, 7) (a shared-prompt
    pair, prompt 2, chosen 2, rejected 3) -> W = 5, one bucket of both rows; row 0 queries /
    keys [0, 1, 2, 3, 0]; row 1 queries [4, 4, 4, 5, 6], keys [0, 1, 4, 5, 6]; output_index
    [0, 1, 2, 3, 7, 8, 9].
    """
    real = [s for s in spans if not s.padding]
    keys = [torch.cat([torch.arange(b, e) for b, e in s.keys]) for s in real]
    widths = [len(k) for k in keys]
    width = max(widths)
    query_index = torch.empty((len(real), width), dtype=torch.int64)
    key_index = torch.empty((len(real), width), dtype=torch.int64)
    output_index = torch.zeros(spans[-1].q_end, dtype=torch.int64)
    buckets, base = [], 0
    for rows in row_buckets(widths):
        bucket_width = max(widths[n] for n in rows)
        for m, n in enumerate(rows):
            s, k = real[n], keys[n]
            n_k, n_q = len(k), s.q_end - s.q_start
            key_index[n, :n_k], key_index[n, n_k:] = k, k[0]
            query_index[n] = s.q_start
            query_index[n, n_k - n_q : n_k] = torch.arange(s.q_start, s.q_end)
            start = base + m * bucket_width + n_k - n_q
            output_index[s.q_start : s.q_end] = torch.arange(start, start + n_q)
        buckets.append((torch.tensor(rows, dtype=torch.int64), bucket_width))
        base += len(rows) * bucket_width
    return SpanRows(query_index, key_index, output_index, tuple(buckets))


@dataclass
class PackedLayout:
    """Where the sequences of packed rows lie: everything an attention kernel needs, built on the
    host by the packing builders (``data.packing``) and read by ``models.attention``.

    Two equivalent forms, for different kernels:

    * per position (dense masks, FlexAttention block masks): query t of row r sees key s iff
      ``segment_ids[r, s] == segment_ids[r, t]``, ``s <= t`` and ``branch_ids[r, s]`` is 0 or
      ``branch_ids[r, t]``;
    * per span (varlen kernels, transformer-engine's THD format): :class:`AttentionSpan` list
      and its cumulative forms ``cu_seqlens_q`` / ``cu_seqlens_kv`` / ``kv_index``, and the
      same spans as square causal rows for one SDPA call (``rows``, :class:`SpanRows`).

    Attributes:
        segment_ids: [R, L] int32, one id per packed unit (a sequence, or a shared-prompt pair);
            a row's unused tail has an id of its own, so every position sees at least itself.
        branch_ids: [R, L] int8 with shared prompts: 0 prompt (seen by both branches), 1 chosen,
            2 rejected; None without them (every position 0).
        spans: the attention problems in flat-position order; their queries tile all R * L
            positions exactly once (host ints: kernels slice with them without a device sync).
        cu_seqlens_q: [P + 1] int32 query boundaries of the P spans in flat positions (THD).
        cu_seqlens_kv: [P + 1] int32 key boundaries of the spans in the gathered key order.
        kv_index: [K] int64 flat positions of the gathered keys (span after span), or None when
            every span's keys are its own queries (then ``cu_seqlens_kv == cu_seqlens_q``).
        max_seqlen_q, max_seqlen_kv: longest span's queries / keys (tokens).
        rows: the spans as :class:`SpanRows` (None for a layout built without them).
    """

    segment_ids: torch.Tensor
    branch_ids: torch.Tensor | None
    spans: tuple[AttentionSpan, ...]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_index: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_kv: int
    rows: SpanRows | None = None

    @classmethod
    def from_spans(
        cls,
        segment_ids: torch.Tensor,
        branch_ids: torch.Tensor | None,
        spans: Sequence[AttentionSpan],
    ) -> PackedLayout:
        """The layout of ``spans`` (host tensors).

        Raises:
            ValueError: spans that do not tile the R * L positions in order, or a span with
                more queries than keys.
        """
        spans = tuple(spans)
        position = 0
        for s in spans:
            n_keys = sum(e - b for b, e in s.keys)
            if s.q_start != position or s.q_end <= s.q_start or n_keys < s.q_end - s.q_start:
                raise ValueError(
                    f"attention span {s} does not continue at position {position} "
                    "or has fewer keys than queries"
                )
            position = s.q_end
        if position != segment_ids.numel():
            raise ValueError(f"attention spans cover {position} of {segment_ids.numel()} positions")
        q_lens = [s.q_end - s.q_start for s in spans]
        kv_lens = [sum(e - b for b, e in s.keys) for s in spans]
        shared = any(s.keys != ((s.q_start, s.q_end),) for s in spans)
        kv_index = (
            torch.cat([torch.arange(b, e) for s in spans for b, e in s.keys]) if shared else None
        )

        def cumulative(lengths):
            return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)

        return cls(
            segment_ids,
            branch_ids,
            spans,
            cumulative(q_lens),
            cumulative(kv_lens),
            kv_index,
            max(q_lens),
            max(kv_lens),
            span_rows(spans),
        )

    def to_device(self) -> PackedLayout:
        """The same layout with its tensors on the engine's device (spans stay host ints)."""
        moved = {
            f.name: to_device(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.rows is not None:
            moved["rows"] = self.rows.to_device()
        return replace(self, **moved)


@dataclass
class MicroBatch:
    """One micro-batch's model inputs: everything the model reads, nothing else (see the module
    docstring for the two layouts). The targets of its item kind, which the loss reads, are
    :attr:`StepBatch.targets`.

    Attributes:
        tokens: [R, L] int64 input ids.
        position_ids: [R, L] int64 positions (RoPE / learned), restarting at each packed sequence
            (a shared-prompt pair's rejected tokens continue from the end of its prompt).
        output_index: [n] int64 flat positions (``r * L + t``) the model's last stage scores, in
            per-sequence order: the scored tokens (sequence 0's completion first), or for a
            reward model each sequence's last token (``RewardTargets.last_index``).
        target_ids: [n] int64 token each scored position predicts (the label, per sequence);
            None for a reward model (its head reads the positions alone).
        num_items: B, items (pairs, examples) in the micro-batch: the weight of its MoE
            routers' load-balancing loss (``models.gpt.ScoringGPTModel``'s
            ``moe_aux_loss_weight``).
        packed: the :class:`PackedLayout` of packed rows (under context parallelism this CP
            rank's ``data.context_split.LocalRows``); None for padded rows (one causal sequence
            per row).
        padding_mask: [R, L] bool of padded rows, True past each sequence's last token
            (megatron-core's convention; MoE routers read it); None for packed rows, whose
            layout says it (a row's unused tail has a negative segment id).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    output_index: torch.Tensor
    target_ids: torch.Tensor | None
    num_items: int
    packed: PackedLayout | None = None
    padding_mask: torch.Tensor | None = None

    @property
    def segment_ids(self) -> torch.Tensor | None:
        """[R, L] segment ids of packed rows (``packed.segment_ids``), None for padded rows."""
        return None if self.packed is None else self.packed.segment_ids

    def to_device(self) -> MicroBatch:
        """The same micro-batch with every tensor on the engine's device."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = to_device(value)
            elif value is not None and hasattr(value, "to_device"):
                moved[f.name] = value.to_device()  # layout, CP rank's LocalRows
        return replace(self, **moved)


@dataclass
class StepBatch:
    """One data-parallel rank's micro-batches of one optimizer step.

    Attributes:
        micro_batches: the model's inputs, in schedule order; all share R x L (the pipeline
            schedule sizes its p2p buffers once per call).
        targets: the loss's targets of each micro-batch (``losses.targets``: ``PairTargets``,
            ``SFTTargets``, ``UnpairedTargets``, ``RewardTargets``; ``data.targets`` makes them),
            aligned with ``micro_batches``.
        seq_length: L, tokens per model row (a multiple of the padding granule).
        real_tokens: non-pad tokens of the sequences this rank's step computes, ``statistic``'s
            included, every sequence counted (a pair's prompt twice, as TRL counts it): the unit
            of the tokens/s metric.
        model_tokens: non-pad positions the model computes (a shared prompt counted once,
            ``statistic``'s included); None means ``real_tokens``.
        item_indices: the dataset indices of each micro-batch's items, in row order (host
            metadata: the step statistic's keys, the precompute pass's table rows).

    Raises:
        ValueError: ``targets`` not one per micro-batch.
    """

    micro_batches: list[MicroBatch]
    targets: list[Targets]
    seq_length: int
    real_tokens: int
    model_tokens: int | None = None
    statistic: StepBatch | None = None
    """The micro-batches the step-statistic pass runs when they are not these
    (:meth:`BatchBuilder.computing`): the same items in the same micro-batches, other sequences
    of them computed (KTO: the mismatched sequences only)."""
    item_indices: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self):
        if len(self.targets) != len(self.micro_batches):
            raise ValueError(
                f"a step batch of {len(self.micro_batches)} micro-batches has "
                f"{len(self.targets)} targets: one per micro-batch"
            )

    @property
    def computed_tokens(self) -> int:
        """Non-pad positions the model runs this step (``model_tokens``, else ``real_tokens``)."""
        return self.real_tokens if self.model_tokens is None else self.model_tokens

    @property
    def has_reference_logps(self) -> bool:
        """True when every micro-batch's targets carry precomputed reference log-probs."""
        return all(t.reference_logps is not None for t in self.targets)

    def to_device(self) -> StepBatch:
        """The host -> device crossing of a step (the only one)."""
        return replace(
            self,
            micro_batches=[mb.to_device() for mb in self.micro_batches],
            targets=[t.to_device() for t in self.targets],
            statistic=None if self.statistic is None else self.statistic.to_device(),
        )


def round_up(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (tokens)."""
    return -(-length // multiple) * multiple


SIDES = ("chosen", "rejected")
"""The two sequences of an item laid out as a pair: per-sequence rows 0..B-1 and B..2B-1."""


class BatchBuilder:
    """Items of one step -> a :class:`StepBatch` (host tensors). Implementations:
    ``data.collate.PaddedPairs``, ``data.collate.SFTExamples``, ``data.packing.PackedPairs`` and
    ``data.packing.SharedPromptPairs`` (a run's: ``data.builders.make_batch_builder``).

    Args:
        pad_token_id: fills padding positions (never scored).
        multiple: padding granule of the step's row length (tokens; includes TP under sequence
            parallelism, which splits rows along the sequence).
        kind: the item kind whose targets the builder makes (``data.kinds.ItemKind.name``;
            ``data.targets``): "pairs", "unpaired" or "reward" for builders of two rows per item,
            "sft" or "reward" for one.
    """

    sequences_per_item = 2
    default_kind = "pairs"

    def computing(
        self, sides: Sequence[str] = SIDES, statistic_sides: Sequence[str] | None = None
    ) -> BatchBuilder:
        """A builder of the same steps whose micro-batches compute only the sequences of
        ``sides`` (of :data:`SIDES`; the others keep their rows of the per-sequence layout,
        with nothing scored: their log-probs read 0), and that attaches, with
        ``statistic_sides``, the same micro-batches computing those as
        :attr:`StepBatch.statistic`. A loss that reads one side in its pass and the other in
        its step statistic (KTO) then computes each sequence once.

        This builder itself where it cannot (padded rows, SFT examples, shared-prompt units,
        which hold both sides): every sequence is computed, and the step statistic reads the
        step's own micro-batches.
        """
        return self

    def __init__(self, pad_token_id: int, multiple: int, kind: str | None = None):
        self.pad_token_id = pad_token_id
        self.multiple = multiple
        self.kind = kind or self.default_kind

    def build(self, items: Sequence, micro_batch_indices: list[list[int]]) -> StepBatch:
        """This rank's micro-batches of one step.

        Args:
            items: the whole (train or eval) list of pairs or examples.
            micro_batch_indices: indices into ``items``, one list per micro-batch
                (``ItemSampler.next_step()``).
        """
        raise NotImplementedError

    def micro_batch_indices(
        self, items: Sequence, micro_batch_indices: list[list[int]]
    ) -> list[list[int]]:
        """The grouping the builder actually uses (bucketing may regroup)."""
        return micro_batch_indices
