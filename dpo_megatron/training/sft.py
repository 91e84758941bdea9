"""The SFT stage's batches: examples of one step -> padded chosen-only micro-batches.

SFT runs through the same engine as DPO (same schedule, loss seam, optimizer, checkpoints):
``loss.name=sft`` reads no rejected completion and no reference model, so each micro-batch holds
B prompt+completion rows instead of 2B, and the loss is called with ``chosen_only=True``
(``training.step._policy_loss``). The loss per example is the per-token negative log-likelihood
of its completion tokens (nats/token); the step averages it over the examples of the step.
"""

from __future__ import annotations

from typing import Sequence

from dpo_megatron.data import SFTExample, collate_sft


def example_length(example: SFTExample) -> int:
    """Prompt + completion tokens."""
    return len(example.prompt_ids) + len(example.completion_ids)


def build_sft_micro_batches(examples: Sequence[SFTExample], micro_batch_indices: list[list[int]],
                            pad_token_id: int, multiple: int):
    """Collate this rank's SFT micro-batches of one step (the SFT twin of
    ``training.batches.build_micro_batches``).

    Args:
        examples: the whole (train or eval) example list.
        micro_batch_indices: ``PairSampler.next_step()`` output for this DP rank (indices of
            examples; ``global_batch_size`` counts examples in the SFT stage).
        multiple: padding granule for the step's sequence length (tokens).

    Returns:
        (micro_batches, seq_length, real_tokens): ``collate_sft`` dicts (tokens / labels /
        position_ids [B, S] int64, loss_mask [B, S] fp32), S (the step's longest row rounded up
        to ``multiple``), and the number of non-pad tokens of this rank's step.
    """
    step_examples = [examples[i] for mb in micro_batch_indices for i in mb]
    longest = max(example_length(e) for e in step_examples)
    seq_length = -(-longest // multiple) * multiple
    micro_batches = [collate_sft([examples[i] for i in mb], pad_token_id, seq_length)
                     for mb in micro_batch_indices]
    return micro_batches, seq_length, sum(example_length(e) for e in step_examples)
