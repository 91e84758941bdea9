"""One DPO step through megatron-core's pipeline schedule.

A step's micro-batches (``dpo_megatron.data.batch.StepBatch``, already on the device) hold B whole
items each: pairs as 2B sequences (chosen rows, then rejected rows) or SFT examples as B rows.
The model reads each ``MicroBatch`` (its inputs only); the loss reads the micro-batch's targets
(``StepBatch.targets``), which the schedule's data iterator yields with it. A step is:

1. when the loss reads a reference and the batch does not carry precomputed reference log-probs,
   the frozen ``reference_model`` runs forward-only through the schedule and returns each
   micro-batch's per-token log-probs on the last stage (:func:`reference_logps`), which go to
   the loss with that micro-batch;
1b. when the loss takes a statistic of the whole step's batch (``losses.registry.StepStatistic``:
   beta-DPO's batch beta and filter, KTO's KL reference point), the policy runs forward-only
   through the schedule, each micro-batch's per-pair values are gathered over the data-parallel
   ranks, and the loss's state turns the global batch's values into the step's inputs
   (:func:`step_statistic_inputs`), the same whatever the layout; each micro-batch's share rides
   with it into step 2. When the batch brings the statistic's own micro-batches
   (``StepBatch.statistic``: KTO's mismatched sequences, while step 2 computes the examples'
   own), that pass runs those, and the reference pass covers them too;
2. the policy runs forward+backward through the schedule; on the last stage the loss function
   turns per-token log-probs into per-pair losses and returns their *sum* with the pair count;
3. megatron-core's ``finalize_model_grads`` (``calculate_per_token_loss=True``) all-reduces the
   pair count over data-parallel (and context-parallel) ranks and divides the gradients by it.
   The loss is therefore normalised by the global number of pairs in the step, whatever
   micro_batch_size, gradient accumulation, data-parallel or context-parallel size:
   sum_i loss_i / N_pairs.

Every item kind goes through the same passes: its micro-batches' targets (``losses.targets``) say
what the model scores (the builder asks them when it lays out ``output_index``) and how its
output reads in the loss's layout, and the loss dispatches on the kind once
(``LossFunction.__call__`` of :func:`sequence_scores`' record). A reward model
(``bradley_terry``) is one such kind: its targets score each sequence's last token
(``RewardTargets.last_index``), its model returns one reward per sequence, and its loss takes
the [2B] rewards. It has no reference.

Mixture-of-experts models add the routers' load-balancing loss to the gradient on every stage
(``dpo_megatron.models.moe``: weighted so that it is the same term on every layout). It is not
part of the preference loss or its metrics: :class:`StepOutput` reports it apart
(``aux_metrics``).

Every tensor made here (collective payloads, counts, the NaN flag) is made on the engine's device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dpo_megatron.data.batch import MicroBatch, StepBatch
from dpo_megatron.losses.targets import SequenceScores, StatisticShare, Targets, TokenTargets
from dpo_megatron.models.moe import load_balancing_metrics
from dpo_megatron.parallel.context import (
    is_first_context_parallel_rank,
    sum_over_context_parallel,
)
from dpo_megatron.parallel.device import get_device
from dpo_megatron.parallel.schedule import run_schedule, share_from_last_stage


@dataclass
class StepOutput:
    """What one step reports (identical on every rank).

    Attributes:
        metrics: loss and the loss's metrics, each averaged over all pairs of the step across
            data-parallel ranks (e.g. ``loss``, ``rewards/margins``, ``logps/chosen``).
        num_items: pairs in the step, all data-parallel ranks together.
        grad_norm: global L2 norm of the gradient before clipping (None for forward-only).
        update_successful: False when the optimizer skipped the step (inf/NaN gradient).
        per_item: this data-parallel rank's per-pair values in micro-batch order ([pairs] each,
            host tensors), on the last pipeline stage only (empty elsewhere).
        aux_metrics: terms of the objective outside the preference loss, for logging: with a
            mixture-of-experts model ``moe/load_balancing_loss`` and ``moe/aux_loss`` (the
            coefficient times it; ``dpo_megatron.models.moe``); empty otherwise and when
            forward-only.
    """

    metrics: dict[str, float]
    num_items: int
    grad_norm: float | None = None
    update_successful: bool = True
    per_item: dict[str, torch.Tensor] = field(default_factory=dict)
    aux_metrics: dict[str, float] = field(default_factory=dict)


def model_forward(model, batch: MicroBatch, log_sum_p2: bool = False):
    """Output of one chunk: hidden states to send on, or on the last stage the scores of the
    micro-batch's ``output_index`` positions: a language model's log-probs of its n scored
    targets (``ScoringGPTModel`` with ``target_ids``: a ``HeadLogps`` of [n] fp32 tensors, the WPO
    normaliser too with ``log_sum_p2``), or a reward model's [N] fp32 rewards (its targets score
    each sequence's last token, with no ``target_ids``). Prompt and padding positions are never
    projected onto the vocabulary, and the scored ones one chunk at a time. Packed rows bring
    their layout (``MicroBatch.packed``); MoE routers get the padding mask and the micro-batch's
    items (their load-balancing weight). The model reads the micro-batch's inputs only, never
    its targets."""
    # Only routers read the mask: dense models skip building it on every micro-batch.
    mask = padding_mask(batch) if model.config.num_moe_experts else None
    return model(
        batch.tokens,
        batch.position_ids,
        packed=batch.packed,
        output_index=batch.output_index,
        target_ids=batch.target_ids,
        log_sum_p2=log_sum_p2,
        padding_mask=mask,
        moe_aux_loss_weight=float(batch.num_items),
    )


def padding_mask(batch: MicroBatch) -> torch.Tensor:
    """[R, L] bool, True at the positions of the model layout that hold no token of a sequence
    (megatron-core's convention), on the batch's device.

    Packed rows: a row's unused tail has a negative segment id (``data.packing``). Padded rows:
    the builder's ``MicroBatch.padding_mask`` (positions past each sequence's last token).
    """
    if batch.segment_ids is not None:
        return batch.segment_ids < 0
    return batch.padding_mask


def token_logps(scored: torch.Tensor, targets: TokenTargets) -> torch.Tensor:
    """[N, S] per-token values (log p(label_t) in nats, or another per-token quantity), zero on
    prompt and padding positions, from the [n] values of the scored positions (the micro-batch's
    ``targets.sequence_layout``).

    Under context parallelism each CP rank scores the tokens it holds (``data.context_split``)
    and the [N, S] tables are summed over the CP group (``parallel.context``: identity backward),
    so every CP rank holds every sequence's log-probs (hence its sums and token counts) and
    computes the same loss once per pair."""
    return sum_over_context_parallel(targets.sequence_layout(scored))


def sequence_scores(
    loss_fn,
    targets: Targets,
    output,
    reference: torch.Tensor | None = None,
    statistic: StatisticShare | None = None,
) -> SequenceScores:
    """The loss's record of one micro-batch: its ``targets``, the policy's last-stage ``output`` in
    the targets' layout (``Targets.policy_values``: [N, S] log-probs, summed over the
    context-parallel group, or [N] rewards), and the values the reference and step-statistic
    passes returned for it."""
    policy, log_sum_p2 = targets.policy_values(output, loss_fn.needs_token_log_sum_p2)
    return SequenceScores(
        targets,
        sum_over_context_parallel(policy),
        reference,
        None if log_sum_p2 is None else sum_over_context_parallel(log_sum_p2),
        statistic,
    )


def _count(n: int) -> torch.Tensor:
    """A count the schedule reduces (megatron-core sums it into ``num_tokens``).

    megatron-core's ``finalize_model_grads`` sums it over the data-parallel-with-context group,
    as DDP sums the gradients; every CP rank computes the same pairs' loss, so only CP rank 0
    counts them and the divisor stays the global pair count whatever CP is."""
    return torch.tensor(
        n if is_first_context_parallel_rank() else 0, dtype=torch.int, device=get_device()
    )


def _reference_forward_step(data_iterator, model):
    batch, targets = next(data_iterator)

    def keep(head):
        values = token_logps(head.token_logps, targets).detach()
        return head.token_logps.new_zeros(()), _count(0), {"token_logps": values}

    return model_forward(model, batch), keep


def _policy_loss(loss_fn, targets: Targets, reference, statistic, output):
    """Last-stage loss of one micro-batch: (sum of per-item losses, item count, per-item
    values)."""
    losses, metrics = loss_fn(sequence_scores(loss_fn, targets, output, reference, statistic))
    reported = {"loss": losses.detach(), **{k: v.detach() for k, v in metrics.items()}}
    return losses.sum(), _count(losses.shape[0]), reported


def _score_forward_step(data_iterator, model):
    batch = next(data_iterator)

    def keep(rewards):
        return rewards.new_zeros(()), _count(0), {"rewards": rewards.detach()}

    return model_forward(model, batch), keep


@torch.no_grad()
def reward_scores(chunks: list, batch: StepBatch) -> list[torch.Tensor]:
    """A reward model's scores of a batch, forward-only through the pipeline schedule.

    Args:
        chunks: this rank's chunks of a reward model (``model.head=reward``).
        batch: this data-parallel rank's micro-batches (on the device) of reward targets
            (``RewardTargets``: the model scores each sequence's ``last_index``).
    Returns:
        On the last pipeline stage one [N] fp32 tensor per micro-batch (the reward of each
        sequence, per-sequence order); an empty list elsewhere.
    """
    store = run_schedule(
        _score_forward_step, chunks, batch.micro_batches, _rows(batch), batch.seq_length, True
    )
    return [entry["rewards"] for entry in store]


def _policy_forward_step(loss_fn, data_iterator, model):
    batch, targets, reference, statistic = next(data_iterator)
    return (
        model_forward(model, batch, log_sum_p2=loss_fn.needs_token_log_sum_p2),
        partial(_policy_loss, loss_fn, targets, reference, statistic),
    )


def _statistic_forward_step(loss_fn, data_iterator, model):
    batch, targets, reference = next(data_iterator)

    def values(head):
        scores = SequenceScores(targets, token_logps(head.token_logps, targets), reference)
        item_values = loss_fn.item_statistics(scores)
        return head.token_logps.new_zeros(()), _count(0), {"values": item_values}

    return model_forward(model, batch), values


@torch.no_grad()
def step_statistic_inputs(
    policy_chunks: list,
    batch: StepBatch,
    reference: list[torch.Tensor | None],
    loss_fn: Callable,
    training: bool,
) -> list[dict]:
    """The loss's step statistic over the global batch, as each micro-batch's loss inputs.

    ``reference``: each micro-batch's [N, S] reference log-probs on the last stage
    (:func:`reference_logps`), None where the loss reads none.

    A forward-only policy pass gives each pair's value (``loss_fn.item_statistics``) on the last
    stage; the values and dataset indices of every data-parallel rank are gathered (rank order),
    shared with the whole pipeline group, and every rank calls ``loss_fn.begin_step`` with them, so
    the loss's state stays identical everywhere. The cost is one extra forward of the policy.

    Returns:
        One :class:`StatisticShare` per micro-batch (the step's scalars and that micro-batch's
        [B] slice of the per-item values, on the device); None per micro-batch off the last
        stage.
    """
    store = run_schedule(
        partial(_statistic_forward_step, loss_fn),
        policy_chunks,
        list(zip(batch.micro_batches, batch.targets, reference)),
        _rows(batch),
        batch.seq_length,
        True,
    )
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    gathered = None
    if last:
        local = (
            torch.cat([d["values"].reshape(-1) for d in store]).double().cpu().tolist(),
            [i for indices in batch.item_indices for i in indices],
        )
        gathered = [None] * parallel_state.get_data_parallel_world_size()
        dist.all_gather_object(gathered, local, group=parallel_state.get_data_parallel_group())
    gathered = share_from_last_stage(gathered)
    values = torch.tensor(
        [v for rank_values, _ in gathered for v in rank_values], dtype=torch.float64
    )
    keys = torch.tensor([k for _, rank_keys in gathered for k in rank_keys], dtype=torch.int64)
    scalars, per_item = loss_fn.begin_step(values, keys, training)
    if not last:
        return [None] * len(batch.micro_batches)
    offset = sum(
        len(rank_values) for rank_values, _ in gathered[: parallel_state.get_data_parallel_rank()]
    )
    inputs = []
    for targets in batch.targets:
        n = targets.num_items
        sliced = {k: v[offset : offset + n].to(get_device()) for k, v in per_item.items()}
        inputs.append(StatisticShare(dict(scalars), sliced))
        offset += n
    return inputs


def _rows(batch: StepBatch) -> int:
    return batch.micro_batches[0].tokens.shape[0]


@torch.no_grad()
def reference_token_logps(reference_chunks: list, batch: StepBatch) -> list[torch.Tensor]:
    """The frozen reference's per-token log-probs of a batch, forward-only through the pipeline
    schedule.

    Returns:
        On the last pipeline stage one [N, S] fp32 tensor per micro-batch (log p(label) in nats
        at the scored positions, 0 elsewhere; no gradient); an empty list elsewhere.
    """
    store = run_schedule(
        _reference_forward_step,
        reference_chunks,
        list(zip(batch.micro_batches, batch.targets)),
        _rows(batch),
        batch.seq_length,
        True,
    )
    return [entry["token_logps"] for entry in store]


def reference_logps(reference, batch: StepBatch) -> list[torch.Tensor | None]:
    """Each micro-batch's [N, S] reference log-probs: those the batch carries (precomputed), else
    the reference pass's (``reference.token_logps(batch)``; collective over the pipeline). Off
    the last pipeline stage, whose loss reads none, None per micro-batch.

    Whether the batch carries reference log-probs is the same on every rank (precomputed values
    travel with the pairs everywhere), so every pipeline stage takes the same decision.

    Raises:
        ValueError: the batch carries none and ``reference`` is None.
    """
    if batch.has_reference_logps:
        return [targets.reference_logps for targets in batch.targets]
    if reference is None:
        raise ValueError(
            "this loss needs reference log-probs: the batch carries none and "
            "no reference model was built"
        )
    values = reference.token_logps(batch)
    return values if values else [None] * len(batch.micro_batches)


def _reduce_per_item(store: list[dict[str, torch.Tensor]]) -> tuple[dict, dict, int]:
    """Per-pair values of this DP rank -> (per_item on the host, metric means over all DP ranks,
    pair count)."""
    keys = list(store[0])
    per_item = {k: torch.cat([d[k].reshape(-1).float() for d in store]) for k in keys}
    count = per_item["loss"].new_tensor(float(per_item["loss"].numel()), dtype=torch.float64)
    sums = torch.stack([per_item[k].double().sum() for k in keys] + [count])
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    sums = sums.tolist()
    total = int(sums[-1])
    return (
        {k: v.cpu() for k, v in per_item.items()},
        {k: sums[i] / total for i, k in enumerate(keys)},
        total,
    )


def run_policy(
    policy_chunks: list, reference, batch: StepBatch, loss_fn: Callable, forward_only: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Reference pass (when the loss needs reference log-probs and the batch carries none), then
    the policy's forward(+backward) over the micro-batches.

    ``reference`` is the run's ``training.reference.ReferenceModel`` (``token_logps(batch)``),
    or None. The reference pass and the step-statistic pass return their values, which go to
    the loss with each micro-batch; nothing is written into the batch.

    Returns:
        On the last pipeline stage, each micro-batch's per-pair values (``loss`` and the loss's
        metrics, [B] device tensors); empty elsewhere.

    Raises:
        ValueError: the loss needs reference log-probs, the batch carries none and no reference
            model was given.
    """
    none = [None] * len(batch.micro_batches)
    reference_values = reference_logps(reference, batch) if loss_fn.needs_reference else none
    if loss_fn.needs_step_statistic(not forward_only):
        # The statistic pass's own micro-batches when the batch brings them (StepBatch.statistic).
        part = batch if batch.statistic is None else batch.statistic
        part_reference = reference_values
        if part is not batch:
            part_reference = reference_logps(reference, part) if loss_fn.needs_reference else none
        inputs = step_statistic_inputs(
            policy_chunks, part, part_reference, loss_fn, training=not forward_only
        )
    else:
        inputs = none
    step = partial(_policy_forward_step, loss_fn)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return run_schedule(
            step,
            policy_chunks,
            list(zip(batch.micro_batches, batch.targets, reference_values, inputs)),
            _rows(batch),
            batch.seq_length,
            forward_only,
        )


def step_forward_backward(
    policy_chunks: list, reference, batch: StepBatch, loss_fn: Callable, forward_only: bool = False
) -> StepOutput:
    """:func:`run_policy`, then its per-pair values reduced over the data-parallel ranks.

    Args:
        policy_chunks: this rank's policy model chunks (DDP-wrapped when training).
        reference: the run's ``ReferenceModel`` (same layout as the policy); None when the loss
            needs no reference or the batches carry precomputed reference log-probs.
        batch: this data-parallel rank's micro-batches for the step, on the device.
        loss_fn: ``dpo_megatron.losses.build_loss(...)`` result.
        forward_only: evaluation (no backward, no gradient).

    Returns:
        StepOutput with metrics averaged over every pair of the step (gradients, when computed,
        are left in the DDP buffers, already divided by the global pair count).
    """
    store = run_policy(policy_chunks, reference, batch, loss_fn, forward_only)
    per_item, metrics, count = ({}, None, 0)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        per_item, metrics, count = _reduce_per_item(store)
        metrics = loss_fn.finish_metrics(metrics, count)
    metrics, count = share_from_last_stage((metrics, count))
    aux = (
        {}
        if forward_only
        else load_balancing_metrics(policy_chunks[0].config, len(batch.micro_batches))
    )
    return StepOutput(metrics=metrics, num_items=count, per_item=per_item, aux_metrics=aux)


def step_is_finite(loss: float, policy_chunks: list) -> bool:
    """False when the step's loss or any gradient is NaN/Inf, on every rank alike.

    Checks each rank's DDP gradient buffers (megatron-core ``DistributedDataParallel``'s
    ``buffers`` and ``expert_parallel_buffers``: ``policy_chunks`` are the DDP-wrapped chunks of
    a training step) after the data-parallel reduction, before the optimizer reads them, and
    all-reduces the verdict over the world, so every rank skips the same step. A NaN/Inf
    anywhere in a rank's buffer would reach the global gradient norm.

    The test is on each buffer's sum: one fused reduction that reads the buffer once and makes
    no temporary of its size (``isfinite`` would make a bool copy of every gradient). A sum is
    NaN/Inf iff an element is, or iff finite elements overflow the dtype's range (|sum| > 3.4e38
    in fp32 / bf16); gradients that large overflow the squared norm too, so skipping such a step
    is what the norm would say.
    """
    bad = torch.zeros(1, device=get_device())
    if not math.isfinite(loss):
        bad.fill_(1.0)
    else:
        sums = [
            buffer.grad_data.sum().float()
            for chunk in policy_chunks
            for buffer in chunk.buffers + chunk.expert_parallel_buffers
        ]
        if sums:
            bad = (~torch.isfinite(torch.stack(sums))).any().float().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0.0


def train_step(
    policy_chunks, reference, optimizer, scheduler, batch: StepBatch, loss_fn
) -> StepOutput:
    """One optimizer step: zero grads, forward+backward over the micro-batches, clip, update.

    The optimizer is megatron-core's (distributed) optimizer; ``scheduler`` its
    ``OptimizerParamScheduler`` stepped once per optimizer step. ``batch`` is on the device.
    """
    for chunk in policy_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    out = step_forward_backward(policy_chunks, reference, batch, loss_fn)
    if not step_is_finite(out.metrics["loss"], policy_chunks):
        # NaN/Inf loss or gradient: no update, no scheduler step (the loop counts these).
        out.grad_norm, out.update_successful = float("nan"), False
        return out
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=1)
    out.grad_norm = None if grad_norm is None else float(grad_norm)
    out.update_successful = bool(update_successful)
    return out
