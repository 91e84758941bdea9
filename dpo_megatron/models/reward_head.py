"""The scalar head of a reward model: one [hidden -> 1] linear map (no bias, as Hugging Face's
``*ForSequenceClassification.score`` with ``num_labels=1``) of the final-norm hidden state of
each sequence's last token, on the last pipeline stage, in place of the LM head.

The head is replicated over the tensor-parallel group: its input is the whole hidden vector on
every TP rank (``ScoringGPTModel._scored_hidden`` gathers it along the sequence first under sequence
parallelism), so every TP rank computes the same rewards and the same gradient for the head;
the hidden states' gradient is then the full one on every rank, as megatron-core's replicated
activations expect. No TP reduction is needed in either direction.

Initialisation is zero: every reward is 0 at step 0 (a Bradley-Terry loss of exactly ln 2),
the same at every layout, whatever the random state of each rank. An imported
``*ForSequenceClassification`` folder overwrites it with its ``score.weight``.
"""

from __future__ import annotations

import torch

HEAD_PARAMETER = "reward_head.weight"
"""The head's parameter name in a model chunk (the conversion tables map it to ``score.weight``)."""


class RewardHead(torch.nn.Module):
    """r = w . h: [n, hidden] -> [n] fp32 rewards (computed in fp32 whatever the model dtype)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight.float()).squeeze(-1)


def attach_reward_head(chunk: torch.nn.Module) -> None:
    """Turn a freshly built last-stage ``ScoringGPTModel`` chunk into a reward model's: its LM head
    (``output_layer``) is removed and a :class:`RewardHead` added as ``reward_head``. Chunks
    that are not on the last stage are left as they are.

    The chunk must have been built with ``share_embeddings_and_output_weights=False``, so no
    word-embedding copy is kept on the last stage and no embedding gradient is tied to it.
    """
    if not chunk.post_process:
        return
    if chunk.share_embeddings_and_output_weights:
        raise ValueError("a reward model's chunk must be built with untied embeddings")
    del chunk.output_layer
    chunk.reward_head = RewardHead(chunk.config.hidden_size)


def reward_head(chunk: torch.nn.Module):
    """The chunk's :class:`RewardHead`, or None (a causal LM, or not the last stage). A
    registered submodule, so not a class attribute default (that would shadow it)."""
    return getattr(chunk, "reward_head", None)
