"""Pairs of one step -> padded micro-batches for the pipeline schedule."""

from __future__ import annotations

from typing import Sequence

from dpo_megatron.data import PreferencePair, collate_pairs, padded_length


def pair_lengths(pair: PreferencePair) -> tuple[int, int]:
    """(prompt+chosen, prompt+rejected) lengths in tokens."""
    p = len(pair.prompt_ids)
    return p + len(pair.chosen_ids), p + len(pair.rejected_ids)


def step_seq_length(pairs: Sequence[PreferencePair], multiple: int) -> int:
    """Longest sequence of the step rounded up to ``multiple`` tokens.

    Every micro-batch of a step shares this length, because the pipeline schedule sizes its
    send/receive buffers once per call. ``multiple`` must include TP under sequence parallelism.
    """
    return padded_length([max(pair_lengths(p)) for p in pairs], multiple)


def build_micro_batches(pairs: Sequence[PreferencePair], micro_batch_indices: list[list[int]],
                        pad_token_id: int, multiple: int):
    """Collate this rank's micro-batches of one step.

    Args:
        pairs: the whole (train or eval) pair list.
        micro_batch_indices: ``PairSampler.next_step()`` output for this DP rank.
        multiple: padding granule for the step's sequence length (tokens).

    Returns:
        (micro_batches, seq_length, real_tokens): collate_pairs dicts [2B, S] each, S, and the
        number of non-pad tokens of this rank's step (chosen and rejected rows together).
    """
    step_pairs = [pairs[i] for mb in micro_batch_indices for i in mb]
    seq_length = step_seq_length(step_pairs, multiple)
    micro_batches = [collate_pairs([pairs[i] for i in mb], pad_token_id, seq_length)
                     for mb in micro_batch_indices]
    real_tokens = sum(sum(pair_lengths(p)) for p in step_pairs)
    return micro_batches, seq_length, real_tokens


def build_step_batches(pairs: Sequence[PreferencePair], micro_batch_indices: list[list[int]],
                       pad_token_id: int, multiple: int, packing=None):
    """Padded (``build_micro_batches``) or packed (``data.packing``) micro-batches of one step.

    Args:
        packing: a ``PackingConfig``; None or ``enabled=False`` gives the padded layout. With
            ``bucket_by_length`` the rank's pairs are regrouped by length first.

    Returns:
        (micro_batches, seq_length, real_tokens, micro_batch_indices): the last is the grouping
        actually used (pair indices per micro-batch), for attaching precomputed reference
        log-probs.
    """
    if packing is None or not packing.enabled:
        return (*build_micro_batches(pairs, micro_batch_indices, pad_token_id, multiple),
                micro_batch_indices)
    from dpo_megatron.data.packing import bucket_micro_batches, build_packed_micro_batches

    if packing.bucket_by_length:
        micro_batch_indices = bucket_micro_batches(pairs, micro_batch_indices)
    return (*build_packed_micro_batches(pairs, micro_batch_indices, pad_token_id, multiple,
                                        packing.row_length), micro_batch_indices)
