"""Evaluation: forward-only metrics over the eval split, and greedy samples for a few prompts.

``evaluate`` runs the same pipeline step as training with ``forward_only=True`` and returns the
pair-weighted means of the loss's metrics (``loss``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen`` ...; for ``sft``: ``nll_loss``, ``logps/chosen``).

``greedy_generate`` decodes a few prompts token by token through the pipeline schedule (one
forward-only pass per new token, no KV cache: meant for a handful of short samples in the
log, not for serving). The next token is the argmax over the vocab-parallel logits, reduced over
the tensor-parallel group without gathering the vocabulary.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from dpo_megatron.training.step import (
    MicroBatch,
    _run_schedule,
    _share_from_last_stage,
    dpo_forward_backward,
)


def evaluate(policy_chunks: list, reference_chunks: Optional[list], loss_fn,
             steps: Iterable[tuple[list[MicroBatch], int]],
             reference_attached: bool = False) -> dict[str, float]:
    """Forward-only pass over eval batches; pair-weighted means of the loss metrics.

    Args:
        steps: (micro_batches, seq_length) per eval step, this data-parallel rank's share.
        reference_attached: the micro-batches already carry reference log-probs.

    Returns:
        metric name -> mean over all evaluated pairs (examples in the SFT stage); {} if none.
    """
    totals: dict[str, float] = {}
    count = 0
    for micro_batches, seq_length in steps:
        out = dpo_forward_backward(policy_chunks, reference_chunks, micro_batches, seq_length,
                                   loss_fn, forward_only=True,
                                   reference_attached=reference_attached)
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0.0) + v * out.num_pairs
        count += out.num_pairs
    return {k: v / count for k, v in totals.items()} if count else {}


def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Greedy token ids from vocab-parallel logits.

    Args:
        logits: [N, V/TP] this TP rank's vocabulary slice (rank r holds ids r*V/TP ...).
        vocab_size: real vocabulary size; padded ids at or above it are never chosen.

    Returns:
        [N] int64 global token ids, identical on every TP rank; ties go to the lowest id.
    """
    shard = logits.shape[-1]
    rank = parallel_state.get_tensor_model_parallel_rank()
    logits = logits.float()
    if vocab_size is not None:
        ids = torch.arange(rank * shard, (rank + 1) * shard)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    values, index = logits.max(dim=-1)
    index = index + rank * shard
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return index
    group = parallel_state.get_tensor_model_parallel_group()
    all_values = [torch.empty_like(values) for _ in range(tp)]
    all_index = [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(all_values, values, group=group)
    dist.all_gather(all_index, index, group=group)
    best = torch.stack(all_values).argmax(dim=0)  # first maximum: the lowest rank, lowest id
    return torch.stack(all_index).gather(0, best.unsqueeze(0)).squeeze(0)


@torch.no_grad()
def greedy_generate(chunks: list, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_ids: Sequence[int], pad_id: int, multiple: int,
                    vocab_size: Optional[int] = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (collective over the whole model-parallel group).

    Args:
        chunks: this rank's policy chunks.
        prompts: token ids per prompt (the same on every rank).
        max_new_tokens: most tokens generated per prompt.
        stop_ids: a generated id in this set ends its row (kept in the output).
        multiple: the padded sequence length is a multiple of this (x TP under SP).

    Returns:
        generated ids per prompt (prompt excluded), identical on every rank.
    """
    rows = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(rows)
    for _ in range(max_new_tokens):
        if all(done):
            break
        lengths = torch.tensor([len(r) for r in rows])
        seq_length = -(-int(lengths.max()) // multiple) * multiple
        tokens = torch.full((len(rows), seq_length), pad_id, dtype=torch.int64)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
        batch = {"tokens": tokens,
                 "position_ids": torch.arange(seq_length).expand(len(rows), -1).contiguous()}
        picked: list[torch.Tensor] = []

        def forward_step(data_iterator, model):
            b = next(data_iterator)

            def pick(logits):  # [N, S, V/TP] on the last stage
                last = logits[torch.arange(len(rows)), lengths - 1]
                picked.append(vocab_parallel_argmax(last, vocab_size))
                return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

            # Plain causal forward: right padding does not reach the positions read here.
            return model(b["tokens"], b["position_ids"], attention_mask=None), pick

        _run_schedule(forward_step, chunks, [batch], seq_length, True)
        next_ids = _share_from_last_stage(picked[0].tolist() if picked else None)
        for i, token in enumerate(next_ids):
            if done[i]:
                continue
            rows[i].append(token)
            generated[i].append(token)
            done[i] = token in stop_ids
    return generated


def write_samples(run_dir: str, step: int, records: list[dict]) -> str:
    """Write decoded samples to ``<run_dir>/samples/step_<step>.jsonl`` (call on one rank);
    returns the path."""
    folder = os.path.join(run_dir, "samples")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step:07d}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
