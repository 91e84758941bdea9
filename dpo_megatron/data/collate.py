"""Micro-batch of pairs -> padded tensors: rows 0..B-1 prompt+chosen, rows B..2B-1 prompt+rejected.

Next-token layout (the reference DPO implementation's ``concatenated_inputs`` with the shift done
here): ``labels[:, t] = tokens[:, t + 1]``, so the logits at position t score ``labels[:, t]`` and
``loss_mask[:, t] = 1`` exactly where ``labels[:, t]`` is a completion token. The first completion
token is thus predicted from the last prompt position, and the per-sequence log-prob of a
completion is ``(logp(labels) * loss_mask).sum(-1)`` (Rafailov et al. 2023, eq. 7's log pi(y|x)).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .pairs import PreferencePair, SFTExample


def collate_rows(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int, seq_length: int
) -> dict[str, torch.Tensor]:
    """(prompt_ids, completion_ids) rows -> tokens/labels/loss_mask/position_ids, each [N, S].

    tokens, labels, position_ids: int64; loss_mask: float32. Padding (right) uses
    ``pad_token_id``; the last label column is padding. Raises ValueError when a row is longer
    than ``seq_length`` or has an empty prompt or completion.
    """
    n = len(rows)
    tokens = torch.full((n, seq_length), pad_token_id, dtype=torch.int64)
    loss_mask = torch.zeros((n, seq_length), dtype=torch.float32)
    for i, (prompt, completion) in enumerate(rows):
        length = len(prompt) + len(completion)
        if length > seq_length:
            raise ValueError(f"row {i} has {length} tokens (prompt {len(prompt)} + completion {len(completion)}) > seq_length {seq_length}")
        if not prompt or not completion:
            raise ValueError(f"row {i} has an empty prompt ({len(prompt)}) or completion ({len(completion)})")
        tokens[i, :length] = torch.tensor([*prompt, *completion], dtype=torch.int64)
        # labels[t] = tokens[t + 1] is a completion token for t in [len(prompt) - 1, length - 1).
        loss_mask[i, len(prompt) - 1 : length - 1] = 1.0
    labels = torch.full_like(tokens, pad_token_id)
    labels[:, :-1] = tokens[:, 1:]
    position_ids = torch.arange(seq_length, dtype=torch.int64).unsqueeze(0).expand(n, -1).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def collate_pairs(pairs: Sequence[PreferencePair], pad_token_id: int, seq_length: int) -> dict[str, torch.Tensor]:
    """B pairs -> 2B rows (prompt+chosen for rows 0..B-1, prompt+rejected for B..2B-1, same pair
    order), right-padded to ``seq_length``. Returns tokens/labels/position_ids [2B, S] int64 and
    loss_mask [2B, S] float32. Raises ValueError if a sequence is longer than ``seq_length``."""
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    return collate_rows(rows, pad_token_id, seq_length)


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int, seq_length: int) -> dict[str, torch.Tensor]:
    """B SFT examples -> B rows, same tensors and layout as ``collate_pairs``."""
    return collate_rows([(e.prompt_ids, e.completion_ids) for e in examples], pad_token_id, seq_length)


def padded_length(lengths: Sequence[int], multiple: int = 8) -> int:
    """max(lengths) rounded up to a multiple of ``multiple`` (the engine's per-step seq_length)."""
    longest = max(lengths)
    return -(-longest // multiple) * multiple
