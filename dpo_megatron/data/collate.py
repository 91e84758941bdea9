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

from collections.abc import Callable, Sequence

import torch

from dpo_megatron.data.batch import BatchBuilder, MicroBatch, StepBatch, round_up
from dpo_megatron.data.pairs import PreferencePair, SFTExample
from dpo_megatron.data.targets import target_maker
from dpo_megatron.losses.targets import Targets

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


def collate_rows(
    rows: Sequence[Row], pad_token_id: int, seq_length: int, make_targets: Callable
) -> tuple[MicroBatch, Targets]:
    """(prompt_ids, completion_ids) rows -> a padded :class:`MicroBatch` of [N, seq_length] and
    its targets, made by ``make_targets(loss_mask, score_index, last_index)``
    (``data.targets``).

    Padding (right) uses ``pad_token_id``; the last label column is padding.

    Raises:
        ValueError: a row longer than ``seq_length``, or an empty prompt or completion.
    """
    check_rows(rows)
    n = len(rows)
    tokens = torch.full((n, seq_length), pad_token_id, dtype=torch.int64)
    lengths = []
    for i, (prompt, completion) in enumerate(rows):
        length = len(prompt) + len(completion)
        if length > seq_length:
            raise ValueError(
                f"row {i} has {length} tokens (prompt {len(prompt)} + completion "
                f"{len(completion)}) > seq_length {seq_length}"
            )
        tokens[i, :length] = torch.tensor([*prompt, *completion], dtype=torch.int64)
        lengths.append(length)
    labels = torch.full_like(tokens, pad_token_id)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = score_mask(rows, seq_length)
    scored = torch.nonzero(loss_mask.reshape(-1)).squeeze(1)
    position_ids = torch.arange(seq_length, dtype=torch.int64).expand(n, -1).contiguous()
    last_index = torch.tensor(
        [i * seq_length + reward_position(p, c, pad_token_id) for i, (p, c) in enumerate(rows)],
        dtype=torch.int64,
    )
    targets = make_targets(loss_mask, scored, last_index)
    output_index, target_ids = targets.model_scores(scored, labels.reshape(-1)[scored])
    inputs = MicroBatch(
        tokens=tokens,
        position_ids=position_ids,
        output_index=output_index,
        target_ids=target_ids,
        num_items=targets.num_items,
        padding_mask=torch.arange(seq_length)[None, :] >= torch.tensor(lengths)[:, None],
    )
    return inputs, targets


def collate_pairs(
    pairs: Sequence[PreferencePair], pad_token_id: int, seq_length: int, kind: str = "pairs"
) -> tuple[MicroBatch, Targets]:
    """B pairs -> 2B padded rows (prompt+chosen for rows 0..B-1, prompt+rejected for B..2B-1,
    same pair order) and ``kind``'s targets (``data.targets``: pairs carry their margins and
    precomputed reference log-probs; unpaired examples their labels).

    Raises:
        ValueError: a sequence longer than ``seq_length`` (see :func:`collate_rows`).
    """
    make = target_maker(kind)
    return collate_rows(
        pair_rows(pairs),
        pad_token_id,
        seq_length,
        lambda loss_mask, scored, last: make(pairs, loss_mask, scored, last),
    )


def collate_sft(
    examples: Sequence[SFTExample], pad_token_id: int, seq_length: int, kind: str = "sft"
) -> tuple[MicroBatch, Targets]:
    """B SFT examples -> B padded rows and their targets, same layout as :func:`collate_pairs`
    (``kind`` "reward": the rows to score with a reward model)."""
    make = target_maker(kind)
    return collate_rows(
        [(e.prompt_ids, e.completion_ids) for e in examples],
        pad_token_id,
        seq_length,
        lambda loss_mask, scored, last: make(examples, loss_mask, scored, last),
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
        built = [
            collate_pairs([items[i] for i in mb], self.pad_token_id, seq_length, self.kind)
            for mb in micro_batch_indices
        ]
        return StepBatch(
            [inputs for inputs, _ in built],
            [targets for _, targets in built],
            seq_length,
            sum(sum(pair_lengths(p)) for p in step),
            item_indices=[tuple(mb) for mb in micro_batch_indices],
        )


def example_length(example: SFTExample) -> int:
    """Prompt + completion tokens."""
    return len(example.prompt_ids) + len(example.completion_ids)


class SFTExamples(BatchBuilder):
    """The SFT stage's batches: B prompt+completion rows per micro-batch (no rejected rows, no
    reference). SFT runs through the same engine as DPO (schedule, loss seam, optimizer,
    checkpoints); ``global_batch_size`` then counts examples."""

    sequences_per_item = 1
    default_kind = "sft"

    def build(self, items: Sequence[SFTExample], micro_batch_indices: list[list[int]]) -> StepBatch:
        step = [items[i] for mb in micro_batch_indices for i in mb]
        seq_length = padded_length([example_length(e) for e in step], self.multiple)
        built = [
            collate_sft([items[i] for i in mb], self.pad_token_id, seq_length, self.kind)
            for mb in micro_batch_indices
        ]
        return StepBatch(
            [inputs for inputs, _ in built],
            [targets for _, targets in built],
            seq_length,
            sum(example_length(e) for e in step),
            item_indices=[tuple(mb) for mb in micro_batch_indices],
        )
