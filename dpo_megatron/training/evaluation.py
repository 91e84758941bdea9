"""Evaluation: forward-only metrics over the eval split, and greedy samples for a few prompts.

:class:`Evaluator` owns when it runs (``train.eval_interval`` and the end of training) and what it
reads: every eval pair (or example), in order, in global batches of ``train.eval_global_batch_size``
(default ``train.global_batch_size``) with a smaller last one, each split over the data-parallel
ranks. It runs the same pipeline step as training with ``forward_only=True`` and reports the
pair-weighted means of the loss's metrics (``loss``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen`` ...; for ``sft``: ``nll_loss``, ``logps/chosen``) and ``items``, the number of
pairs (or examples) they are the means of.

Greedy samples of a few eval prompts come from ``dpo_megatron.generation.generate`` (the trainer
calls it; ``write_samples`` writes them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch.distributed as dist
from megatron.core import parallel_state

from dpo_megatron.data.batch import BatchBuilder
from dpo_megatron.parallel.schedule import share_from_last_stage
from dpo_megatron.training.config import TrainConfig
from dpo_megatron.training.step import run_policy
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
        train: the ``train`` config section: items per eval step (``eval_global_batch_size``, or
            ``global_batch_size``) and per micro-batch (``micro_batch_size``), evaluate every
            ``eval_interval`` steps (0: only at the end) over ``eval_iters`` steps (0: the whole
            split), and before the first step with ``eval_at_start``.
        items: the eval pairs (or SFT examples); with ``reference.mode=precomputed`` they carry
            their reference log-probs and no reference model is needed.
        builder: the run's batch builder (padded, packed or SFT).
    """

    def __init__(self, train: TrainConfig, *, items: Sequence, builder: BatchBuilder):
        self.items = items
        self.builder = builder
        self.global_batch_size = train.eval_global_batch_size or train.global_batch_size
        self.micro_batch_size = train.micro_batch_size
        self.interval = train.eval_interval
        self.max_steps = train.eval_iters
        self.at_start = train.eval_at_start

    def due(self, step: int, last_step: int) -> bool:
        """Whether to evaluate after ``step`` (every ``interval`` steps, and after the last);
        ``step`` 0 is before the first step (``at_start``)."""
        if not self.items:
            return False
        if step == 0:
            return self.at_start
        return step == last_step or bool(self.interval and step % self.interval == 0)

    def steps(self) -> list[list[list[int]]]:
        """This data-parallel rank's micro-batches of every eval step
        (:func:`eval_micro_batch_indices`; ``max_steps`` not applied)."""
        return eval_micro_batch_indices(
            len(self.items),
            self.global_batch_size,
            self.micro_batch_size,
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )

    def run(self, policy_chunks: list, reference, loss_fn) -> dict[str, float]:
        """Metric name -> mean over all evaluated pairs, and ``items``: their number
        (collective); {} for an empty split.

        Each rank sums its own pairs' values over all eval steps (a rank may have none in the
        last, smaller step); the sums are combined over the data-parallel ranks once, at the
        end, and shared from the last pipeline stage.
        """
        steps = self.steps()
        if self.max_steps:
            steps = steps[: self.max_steps]
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        sums: dict[str, float] = {}
        count = 0
        builder = self.builder.computing(loss_fn.loss_sides)  # the sequences the loss reads
        for micro_batch_indices in steps:
            if not micro_batch_indices:
                continue  # no item for this rank in the last, smaller step
            batch = builder.build(self.items, micro_batch_indices).to_device()
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
        return share_from_last_stage(metrics)


def write_samples(layout: RunLayout, step: int, records: list[dict]) -> str:
    """Write decoded samples to ``<run_dir>/samples/step_<step>.jsonl`` (call on one rank);
    returns the path."""
    os.makedirs(layout.samples, exist_ok=True)
    path = layout.samples_file(step)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
