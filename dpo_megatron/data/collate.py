"""Micro-batch of pairs -> padded tensors: rows 0..B-1 prompt+chosen, rows B..2B-1 prompt+rejected.

Next-token layout (the reference DPO implementation's ``concatenated_inputs`` with the shift done
here): ``labels[:, t] = tokens[:, t + 1]``, so the logits at position t score ``labels[:, t]`` and
``loss_mask[:, t] = 1`` exactly where ``labels[:, t]`` is a completion token. The first completion
token is thus predicted from the last prompt position, and the per-sequence log-prob of a
completion is ``(logp(labels) * loss_mask).sum(-1)`` (Rafailov et al. 2023, eq. 7's log pi(y|x)).

In a padded batch the model layout and the per-sequence layout are the same [N, S] grid, so
``output_index == score_index`` (``data.batch``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dpo_megatron.data.batch import BatchBuilder, MicroBatch, StepBatch, round_up
from dpo_megatron.data.pairs import PreferencePair, SFTExample, UnpairedPair

Row = tuple[Sequence[int], Sequence[int]]
"""(prompt_ids, completion_ids) of one sequence."""


def pair_rows(pairs: Sequence[PreferencePair]) -> list[Row]:
    """B pairs -> 2B (prompt, completion) rows: chosen rows first, then rejected (batch order)."""
    return [(p.prompt_ids, p.chosen_ids) for p in pairs] + [
        (p.prompt_ids, p.rejected_ids) for p in pairs
    ]


def check_rows(rows: Sequence[Row]) -> None:
    """Raises ValueError for a row with an empty prompt or completion (nothing to condition on,
    or nothing to score)."""
    for i, (prompt, completion) in enumerate(rows):
        if not prompt or not completion:
            raise ValueError(
                f"row {i} has an empty prompt ({len(prompt)}) or completion ({len(completion)})"
            )


def score_mask(rows: Sequence[Row], length: int) -> torch.Tensor:
    """[N, length] fp32 loss mask of the per-sequence layout: labels[t] = tokens[t + 1] is a
    completion token for t in [len(prompt) - 1, len(prompt) + len(completion) - 1)."""
    mask = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, (prompt, completion) in enumerate(rows):
        mask[i, len(prompt) - 1 : len(prompt) + len(completion) - 1] = 1.0
    return mask


def score_targets(
    rows: Sequence[Row], loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(score_index, target_ids) of the per-sequence layout: the flat positions ``i * S + t`` of
    the scored tokens ([n] int64, row-major) and the token each predicts, ``ids_i[t + 1]`` with
    ``ids_i`` = prompt + completion of row i ([n] int64)."""
    n, length = loss_mask.shape
    ids = torch.zeros((n, length + 1), dtype=torch.int64)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, : len(prompt) + len(completion)] = torch.tensor([*prompt, *completion])
    score_index = torch.nonzero(loss_mask.reshape(-1)).squeeze(1)
    return score_index, ids[:, 1:].reshape(-1)[score_index]


def reward_position(prompt: Sequence[int], completion: Sequence[int], pad_token_id: int) -> int:
    """Index in ``prompt + completion`` of the token whose final hidden state a reward model
    scores: the last token that is not ``pad_token_id`` (Hugging Face's
    ``*ForSequenceClassification`` rule, so an exported reward model scores the same sequence
    the same way; with SmolLM2, whose pad is its end-of-turn token, that is the token before a
    closing ``<|im_end|>``), or the last token when every token is ``pad_token_id``."""
    ids = [*prompt, *completion]
    for t in range(len(ids) - 1, -1, -1):
        if ids[t] != pad_token_id:
            return t
    return len(ids) - 1


def pair_margins(pairs: Sequence[PreferencePair]) -> Optional[torch.Tensor]:
    """[B] fp32 margins of the pairs (``PreferencePair.margin``; 0 for a pair without one), or
    None when none has one."""
    margins = [getattr(p, "margin", None) for p in pairs]
    if all(m is None for m in margins):
        return None
    return torch.tensor([0.0 if m is None else m for m in margins], dtype=torch.float32)


def desirable_labels(pairs: Sequence[PreferencePair]) -> Optional[torch.Tensor]:
    """[B] fp32 labels of unpaired examples (``UnpairedPair.desirable``: 1.0 / 0.0), or None for
    preference pairs.

    Raises:
        ValueError: a micro-batch mixes unpaired examples and pairs.
    """
    labels = [p.desirable if isinstance(p, UnpairedPair) else None for p in pairs]
    if all(label is None for label in labels):
        return None
    if any(label is None for label in labels):
        raise ValueError("a micro-batch mixes unpaired examples and preference pairs")
    return torch.tensor([float(label) for label in labels], dtype=torch.float32)


def reference_logps(
    pairs: Sequence[PreferencePair],
    loss_mask: torch.Tensor,
    computed: Optional[Sequence[bool]] = None,
) -> Optional[torch.Tensor]:
    """[2B, S] precomputed reference log-probs at the scored positions (0 elsewhere), or None
    when the pairs carry none. ``computed`` [2B]: False for a sequence the micro-batch does not
    compute (``BatchBuilder.computing``), whose row stays 0; None: every sequence.

    Raises:
        ValueError: some pairs carry values and others do not, or a pair's values do not match
            its completion length (a stale table).
    """
    carried = [p.reference_chosen_logps is not None for p in pairs]
    if not any(carried):
        return None
    if not all(carried):
        raise ValueError(
            "a micro-batch mixes pairs with and without precomputed reference log-probs"
        )
    rows = [p.reference_chosen_logps for p in pairs] + [p.reference_rejected_logps for p in pairs]
    computed = [True] * len(rows) if computed is None else list(computed)
    counts = loss_mask.sum(-1).long().tolist()
    for k, (values, n) in enumerate(zip(rows, counts)):
        if computed[k] and values.numel() != n:
            raise ValueError(
                f"precomputed reference row {k} has {values.numel()} values for {n} "
                "completion tokens: the table is stale"
            )
    out = torch.zeros_like(loss_mask)
    laid = [values for values, keep in zip(rows, computed) if keep]
    if laid:
        out[loss_mask.bool()] = torch.cat(laid).to(out.dtype)
    return out


def collate_rows(
    rows: Sequence[Row], pad_token_id: int, seq_length: int, sequences_per_item: int = 2
) -> MicroBatch:
    """(prompt_ids, completion_ids) rows -> a padded :class:`MicroBatch` of [N, seq_length].

    Padding (right) uses ``pad_token_id``; the last label column is padding.

    Raises:
        ValueError: a row longer than ``seq_length``, or an empty prompt or completion.
    """
    check_rows(rows)
    n = len(rows)
    tokens = torch.full((n, seq_length), pad_token_id, dtype=torch.int64)
    for i, (prompt, completion) in enumerate(rows):
        length = len(prompt) + len(completion)
        if length > seq_length:
            raise ValueError(
                f"row {i} has {length} tokens (prompt {len(prompt)} + completion "
                f"{len(completion)}) > seq_length {seq_length}"
            )
        tokens[i, :length] = torch.tensor([*prompt, *completion], dtype=torch.int64)
    labels = torch.full_like(tokens, pad_token_id)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = score_mask(rows, seq_length)
    scored = torch.nonzero(loss_mask.reshape(-1)).squeeze(1)
    position_ids = torch.arange(seq_length, dtype=torch.int64).expand(n, -1).contiguous()
    last_index = torch.tensor(
        [i * seq_length + reward_position(p, c, pad_token_id) for i, (p, c) in enumerate(rows)],
        dtype=torch.int64,
    )
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        position_ids=position_ids,
        loss_mask=loss_mask,
        output_index=scored,
        score_index=scored,
        target_ids=labels.reshape(-1)[scored],
        sequences_per_item=sequences_per_item,
        last_index=last_index,
    )


def collate_pairs(
    pairs: Sequence[PreferencePair], pad_token_id: int, seq_length: int
) -> MicroBatch:
    """B pairs -> 2B padded rows (prompt+chosen for rows 0..B-1, prompt+rejected for B..2B-1,
    same pair order), with the pairs' precomputed reference log-probs when they carry them.

    Raises:
        ValueError: a sequence longer than ``seq_length`` (see :func:`collate_rows`).
    """
    batch = collate_rows(pair_rows(pairs), pad_token_id, seq_length)
    batch.reference_logps = reference_logps(pairs, batch.loss_mask)
    batch.desirable = desirable_labels(pairs)
    batch.margin = pair_margins(pairs)
    return batch


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int, seq_length: int) -> MicroBatch:
    """B SFT examples -> B padded rows (``sequences_per_item=1``), same layout as
    :func:`collate_pairs`."""
    return collate_rows(
        [(e.prompt_ids, e.completion_ids) for e in examples],
        pad_token_id,
        seq_length,
        sequences_per_item=1,
    )


def padded_length(lengths: Sequence[int], multiple: int = 8) -> int:
    """max(lengths) rounded up to a multiple of ``multiple`` (the engine's per-step seq_length)."""
    return round_up(max(lengths), multiple)


def pair_lengths(pair: PreferencePair) -> tuple[int, int]:
    """(prompt+chosen, prompt+rejected) lengths in tokens."""
    p = len(pair.prompt_ids)
    return p + len(pair.chosen_ids), p + len(pair.rejected_ids)


class PaddedPairs(BatchBuilder):
    """Padded pairs: every micro-batch of a step is 2B rows of the step's longest sequence
    (rounded up to ``multiple``), because the pipeline schedule sizes its buffers once per
    step."""

    def build(
        self, items: Sequence[PreferencePair], micro_batch_indices: list[list[int]]
    ) -> StepBatch:
        step = [items[i] for mb in micro_batch_indices for i in mb]
        seq_length = padded_length([max(pair_lengths(p)) for p in step], self.multiple)
        micro_batches = []
        for mb in micro_batch_indices:
            batch = collate_pairs([items[i] for i in mb], self.pad_token_id, seq_length)
            batch.item_indices = tuple(mb)
            micro_batches.append(batch)
        return StepBatch(micro_batches, seq_length, sum(sum(pair_lengths(p)) for p in step))


def example_length(example: SFTExample) -> int:
    """Prompt + completion tokens."""
    return len(example.prompt_ids) + len(example.completion_ids)


class SFTExamples(BatchBuilder):
    """The SFT stage's batches: B prompt+completion rows per micro-batch (no rejected rows, no
    reference). SFT runs through the same engine as DPO (schedule, loss seam, optimizer,
    checkpoints); ``global_batch_size`` then counts examples."""

    sequences_per_item = 1

    def build(self, items: Sequence[SFTExample], micro_batch_indices: list[list[int]]) -> StepBatch:
        step = [items[i] for mb in micro_batch_indices for i in mb]
        seq_length = padded_length([example_length(e) for e in step], self.multiple)
        micro_batches = []
        for mb in micro_batch_indices:
            batch = collate_sft([items[i] for i in mb], self.pad_token_id, seq_length)
            batch.item_indices = tuple(mb)
            micro_batches.append(batch)
        return StepBatch(micro_batches, seq_length, sum(example_length(e) for e in step))
