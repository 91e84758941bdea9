"""Evaluation: forward-only metrics over the eval split, and greedy samples for a few prompts.

:class:`Evaluator` owns when it runs (``train.eval_interval`` and the end of training) and what it
reads: every eval pair (or example), in order, in global batches of ``train.eval_global_batch_size``
(default ``train.global_batch_size``) with a smaller last one, each split over the data-parallel
ranks. It runs the same pipeline step as training with ``forward_only=True`` and reports the
pair-weighted means of the loss's metrics (``loss``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen`` ...; for ``sft``: ``nll_loss``, ``logps/chosen``) and ``items``, the number of
pairs (or examples) they are the means of.

``greedy_generate`` decodes a few prompts token by token through the pipeline schedule (one
forward-only pass per new token, no KV cache: meant for a handful of short samples in the
log, not for serving). The next token is the argmax over the vocab-parallel logits, reduced over
the tensor-parallel group without gathering the vocabulary.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dpo_megatron.data.batch import BatchBuilder
from dpo_megatron.parallel.device import get_device, to_device
from dpo_megatron.training.step import _share_from_last_stage, run_policy, run_schedule
from dpo_megatron.utils.run_layout import RunLayout


def eval_micro_batch_indices(
    num_items: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[list[int]]]:
    """This data-parallel rank's micro-batches of each eval step, covering all ``num_items``.

    Items are taken in order, ``global_batch_size`` per step (the last step smaller); a step's
    items are split into contiguous equal shares over the DP ranks (the last ranks may get fewer
    or none) and each share into micro-batches of ``micro_batch_size``. A share that does not
    fill whole micro-batches becomes one micro-batch of its size, so every micro-batch of a step
    on this rank has the same number of rows (the pipeline's buffers need one shape per call).

    Example: 10 items, global 4, micro 2, DP 2: rank 0 -> [[[0, 1]], [[4, 5]], [[8]]],
    rank 1 -> [[[2, 3]], [[6, 7]], [[9]]].
    """
    steps = []
    for start in range(0, num_items, global_batch_size):
        step_items = list(range(start, min(start + global_batch_size, num_items)))
        share = -(-len(step_items) // dp_size)
        mine = step_items[dp_rank * share : (dp_rank + 1) * share]
        if len(mine) % micro_batch_size == 0:
            steps.append(
                [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
            )
        else:
            steps.append([mine] if mine else [])
    return steps


class Evaluator:
    """Forward-only evaluation of the policy over an eval split.

    Args:
        items: the eval pairs (or SFT examples); with ``reference.mode=precomputed`` they carry
            their reference log-probs and no reference model is needed.
        builder: the run's batch builder (padded, packed or SFT).
        global_batch_size, micro_batch_size: items per eval step (``train.eval_global_batch_size``
            or ``train.global_batch_size``) and per micro-batch (``train.micro_batch_size``).
        interval: evaluate every this many steps (0: only at the end).
        max_steps: ``train.eval_iters`` (0: the whole split).
        at_start: also evaluate before the first step (``train.eval_at_start``).
    """

    def __init__(
        self,
        items: Sequence,
        builder: BatchBuilder,
        global_batch_size: int,
        micro_batch_size: int,
        interval: int = 0,
        max_steps: int = 0,
        at_start: bool = False,
    ):
        self.items = items
        self.builder = builder
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.interval = interval
        self.max_steps = max_steps
        self.at_start = at_start

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after ``step`` (every ``interval`` steps, and after the last);
        ``step`` 0 is before the first step (``at_start``)."""
        if not self.items:
            return False
        if step == 0:
            return self.at_start
        return step == last_step or bool(self.interval and step % self.interval == 0)

    def run(self, policy_chunks: list, reference, loss_fn) -> dict[str, float]:
        """Metric name -> mean over all evaluated pairs, and ``items``: their number
        (collective); {} for an empty split.

        Each rank sums its own pairs' values over all eval steps (a rank may have none in the
        last, smaller step); the sums are combined over the data-parallel ranks once, at the
        end, and shared from the last pipeline stage.
        """
        steps = eval_micro_batch_indices(
            len(self.items),
            self.global_batch_size,
            self.micro_batch_size,
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )
        if self.max_steps:
            steps = steps[: self.max_steps]
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        sums: dict[str, float] = {}
        count = 0
        for micro_batch_indices in steps:
            if not micro_batch_indices:
                continue  # no item for this rank in the last, smaller step
            batch = self.builder.build(self.items, micro_batch_indices).to_device()
            store = run_policy(policy_chunks, reference, batch, loss_fn, forward_only=True)
            if last:
                for values in store:
                    for k, v in values.items():
                        sums[k] = sums.get(k, 0.0) + float(v.double().sum())
                    count += int(values["loss"].numel())
        metrics = None
        if last:
            parts = [None] * parallel_state.get_data_parallel_world_size()
            dist.all_gather_object(
                parts, (sums, count), group=parallel_state.get_data_parallel_group()
            )
            total = sum(n for _, n in parts)
            keys = list(dict.fromkeys(k for part, _ in parts for k in part))  # first-seen order
            metrics = (
                loss_fn.finish_metrics(
                    {k: sum(part.get(k, 0.0) for part, _ in parts) / total for k in keys}, total
                )
                | {"items": total}
                if total
                else {}
            )
        return _share_from_last_stage(metrics)


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
        ids = torch.arange(rank * shard, (rank + 1) * shard, device=logits.device)
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
def greedy_generate(
    chunks: list,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    multiple: int,
    vocab_size: Optional[int] = None,
) -> list[list[int]]:
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
        lengths = [len(r) for r in rows]
        seq_length = -(-max(lengths) // multiple) * multiple
        tokens = torch.full((len(rows), seq_length), pad_id, dtype=torch.int64)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        positions = torch.arange(seq_length).expand(len(rows), -1).contiguous()
        # The last real position of each row, flat in [rows * seq_length]: the only logits read.
        last = torch.tensor([i * seq_length + n - 1 for i, n in enumerate(lengths)])
        batch = [(to_device(tokens), to_device(positions), to_device(last))]
        picked: list[torch.Tensor] = []

        def forward_step(data_iterator, model):
            tokens_, positions_, last_ = next(data_iterator)

            def pick(logits):  # [1, rows, V/TP] on the last stage
                picked.append(vocab_parallel_argmax(logits[0], vocab_size))
                return (
                    logits.new_zeros(()),
                    torch.tensor(0, dtype=torch.int, device=get_device()),
                    {},
                )

            # Plain causal forward: right padding does not reach the positions read here.
            return model(tokens_, positions_, output_index=last_), pick

        run_schedule(forward_step, chunks, batch, len(rows), seq_length, True)
        next_ids = _share_from_last_stage(picked[0].tolist() if picked else None)
        for i, token in enumerate(next_ids):
            if done[i]:
                continue
            rows[i].append(token)
            generated[i].append(token)
            done[i] = token in stop_ids
    return generated


def write_samples(layout: RunLayout, step: int, records: list[dict]) -> str:
    """Write decoded samples to ``<run_dir>/samples/step_<step>.jsonl`` (call on one rank);
    returns the path."""
    os.makedirs(layout.samples, exist_ok=True)
    path = layout.samples_file(step)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
