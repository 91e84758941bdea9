"""Unpaired examples (KTO) -> the pair layout the engine trains on, with KTO's mismatched
completions.

KTO estimates its reference point KL(pi || pi_ref) from completions that do not belong to their
prompt (Ethayarajh et al. 2024, Sec. 4.1). TRL builds them by shifting the completions of a batch
by one (example i gets the completion of example i - 1); here the shift runs over the whole split
once, when the data is loaded, so which completion an example is measured with never depends on
the batch size, the data-parallel size or the order the sampler draws in.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpo_megatron.data.pairs import UnpairedExample, UnpairedPair


def with_kl_completions(examples: Sequence[UnpairedExample], max_length: int) -> list[UnpairedPair]:
    """Each example as an :class:`UnpairedPair` whose ``rejected_ids`` is the completion of the
    example before it (cyclically: example 0 gets the last one's; a single example its own).

    The mismatched completion is cut to the room its prompt leaves under ``max_length`` (tokens;
    0 = no limit), keeping its start, as the example's own completion was cut.
    """
    pairs = []
    for i, example in enumerate(examples):
        other = examples[i - 1].completion_ids
        if max_length:
            other = other[: max(1, max_length - len(example.prompt_ids))]
        pairs.append(
            UnpairedPair(
                example.prompt_ids,
                example.completion_ids,
                tuple(other),
                desirable=example.desirable,
            )
        )
    return pairs


def label_counts(items: Sequence) -> dict[str, int]:
    """{"desirable": n_D, "undesirable": n_U} of unpaired items (anything with ``desirable``)."""
    desirable = sum(1 for item in items if item.desirable)
    return {"desirable": desirable, "undesirable": len(items) - desirable}
