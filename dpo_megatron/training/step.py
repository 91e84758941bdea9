"""One DPO step through megatron-core's pipeline schedule.

A micro-batch holds B whole pairs as 2B sequences (rows 0..B-1 chosen, B..2B-1 rejected), so
chosen and rejected of a pair always meet on the same last-stage rank (a loss that reads no
rejected completion, ``sft``, gets B chosen rows only). A step is:

1. the frozen ``reference_model`` runs forward-only through the schedule; on the last stage its
   per-token log-probs are attached to each micro-batch (``"reference_token_logps"``);
2. the policy runs forward+backward through the schedule; on the last stage the loss function
   turns per-token log-probs into per-pair losses and returns their *sum* with the pair count;
3. megatron-core's ``finalize_model_grads`` (``calculate_per_token_loss=True``) all-reduces the
   pair count over data-parallel ranks and divides the gradients by it. The loss is therefore
   normalised by the global number of pairs in the step, whatever micro_batch_size, gradient
   accumulation or data-parallel size: sum_i loss_i / N_pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dpo_megatron.models.gpt import output_positions, rotary_position_ids
from dpo_megatron.training.logprobs import vocab_parallel_log_sum_p2, vocab_parallel_token_logps

MicroBatch = dict[str, torch.Tensor]
"""collate_pairs output: tokens / labels / position_ids [2B, S] int64, loss_mask [2B, S] fp32."""


@dataclass
class StepOutput:
    """What one step reports (identical on every rank).

    Attributes:
        metrics: loss and the loss's metrics, each averaged over all pairs of the step across
            data-parallel ranks (e.g. ``loss``, ``rewards/margins``, ``logps/chosen``).
        num_pairs: pairs in the step, all data-parallel ranks together.
        grad_norm: global L2 norm of the gradient before clipping (None for forward-only).
        update_successful: False when the optimizer skipped the step (inf/NaN gradient).
        per_pair: this data-parallel rank's per-pair values in micro-batch order ([pairs] each),
            on the last pipeline stage only (empty elsewhere); used by tests and evaluation.
    """

    metrics: dict[str, float]
    num_pairs: int
    grad_norm: Optional[float] = None
    update_successful: bool = True
    per_pair: dict[str, torch.Tensor] = field(default_factory=dict)


def _scored_positions(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the scored (completion) tokens: (in the model's [rows, L] input, in the
    padded [2B, S] layout). Equal unless the batch is packed."""
    flat = torch.nonzero(batch["loss_mask"].reshape(-1)).squeeze(1)
    if "unpack_index" in batch:
        return batch["unpack_index"].reshape(-1)[flat], flat
    return flat, flat


def _model_forward(model, batch: MicroBatch) -> torch.Tensor:
    """Output of one chunk: hidden states to send on, or on the last stage [1, n, V/TP] logits of
    the n scored positions only (``models.gpt.output_positions``: prompt and padding positions
    are never projected onto the vocabulary).

    A packed batch (``dpo_megatron.data.packing``) brings its block-diagonal causal
    ``attention_mask`` and per-sequence positions; a padded one uses the built-in causal mask.
    """
    with output_positions(model, _scored_positions(batch)[0]):
        if "attention_mask" in batch:
            with rotary_position_ids(model, batch["position_ids"]):
                return model(batch["tokens"], batch["position_ids"],
                             attention_mask=batch["attention_mask"])
        return model(batch["tokens"], batch["position_ids"], attention_mask=None)


def _to_padded_layout(values: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """[n] values of the scored positions -> [2B, S] (zero elsewhere); differentiable."""
    flat = _scored_positions(batch)[1]
    mask = batch["loss_mask"]
    return values.new_zeros(mask.numel()).index_put((flat,), values.reshape(-1)).view(mask.shape)


def _token_logps(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """[2B, S] log p(label_t), zero on prompt and padding positions (nats)."""
    labels = batch["labels"].reshape(-1)[_scored_positions(batch)[0]]
    logps = vocab_parallel_token_logps(logits.reshape(-1, logits.shape[-1]), labels)
    return _to_padded_layout(logps, batch) * batch["loss_mask"]


def _reference_forward_step(data_iterator, model):
    batch = next(data_iterator)

    def store(logits):
        batch["reference_token_logps"] = _token_logps(logits, batch).detach()
        return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

    return _model_forward(model, batch), store


def _policy_loss(loss_fn, batch: MicroBatch, logits: torch.Tensor):
    """Last-stage loss of one micro-batch: (sum of per-pair losses, pair count, per-pair values)."""
    policy_token_logps = _token_logps(logits, batch)
    log_sum_p2 = (_to_padded_layout(vocab_parallel_log_sum_p2(logits), batch)
                  if getattr(loss_fn, "needs_token_log_sum_p2", False) else None)
    # A loss that reads no rejected completion (``sft``) is given chosen rows only
    # (``training.sft.build_sft_micro_batches``): B rows, not 2B.
    chosen_only = not getattr(loss_fn, "needs_rejected", True)
    losses, metrics = loss_fn(policy_token_logps, batch.get("reference_token_logps"),
                              batch["loss_mask"], log_sum_p2,
                              **({"chosen_only": True} if chosen_only else {}))
    reported = {"loss": losses.detach(), **{k: v.detach() for k, v in metrics.items()}}
    return losses.sum(), torch.tensor(losses.shape[0], dtype=torch.int), reported


def _policy_forward_step(loss_fn, data_iterator, model):
    batch = next(data_iterator)
    return _model_forward(model, batch), partial(_policy_loss, loss_fn, batch)


def _iterators(micro_batches: list[MicroBatch], num_chunks: int):
    """One iterator per model chunk (the interleaved schedule pulls from each separately)."""
    its = [iter(micro_batches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]


def _run_schedule(forward_step_func, chunks, micro_batches, seq_length, forward_only):
    pairs = micro_batches[0]["tokens"].shape[0]  # 2B sequences per micro-batch
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=_iterators(micro_batches, len(chunks)),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=pairs,  # the schedule sizes p2p buffers: 2B sequences, not B pairs
        forward_only=forward_only,
    )


@torch.no_grad()
def attach_reference_logps(reference_chunks: list, micro_batches: list[MicroBatch],
                           seq_length: int) -> None:
    """Run the frozen reference forward-only; store ``reference_token_logps`` [2B, S] in each
    micro-batch on the last pipeline stage (other stages are left unchanged)."""
    _run_schedule(_reference_forward_step, reference_chunks, micro_batches, seq_length, True)


def _reduce_per_pair(store: list[dict[str, torch.Tensor]]) -> tuple[dict, dict, int]:
    """Per-pair values of this DP rank -> (per_pair, metric means over all DP ranks, pairs)."""
    keys = list(store[0])
    per_pair = {k: torch.cat([d[k].reshape(-1).float() for d in store]) for k in keys}
    sums = torch.stack([per_pair[k].double().sum() for k in keys]
                       + [torch.tensor(float(per_pair["loss"].numel()), dtype=torch.float64)])
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    count = int(sums[-1].item())
    return per_pair, {k: float(sums[i] / count) for i, k in enumerate(keys)}, count


def _share_from_last_stage(payload: Any) -> Any:
    """Broadcast a Python object from the last pipeline stage to the whole pipeline group."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(
        box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]


def dpo_forward_backward(
    policy_chunks: list,
    reference_chunks: Optional[list],
    micro_batches: list[MicroBatch],
    seq_length: int,
    loss_fn: Callable,
    forward_only: bool = False,
    reference_attached: bool = False,
) -> StepOutput:
    """Reference pass (if any), then the policy's forward(+backward) over all micro-batches.

    Args:
        policy_chunks: this rank's policy model chunks (DDP-wrapped when training).
        reference_chunks: the reference model's chunks, same layout; None for reference-free
            losses.
        micro_batches: this data-parallel rank's micro-batches for the step, each padded to
            ``seq_length`` tokens (divisible by TP under sequence parallelism).
        loss_fn: ``dpo_megatron.losses.build_loss(...)`` result.
        forward_only: evaluation (no backward, no gradient).
        reference_attached: the micro-batches already carry ``reference_token_logps`` on the
            last stage (``training.reference.ReferenceSource``): run no reference pass. Must be
            the same on every rank.

    Returns:
        StepOutput with metrics averaged over every pair of the step (gradients, when computed,
        are left in the DDP buffers, already divided by the global pair count).
    """
    if getattr(loss_fn, "needs_reference", True) and not reference_attached:
        if reference_chunks is None:
            raise ValueError("this loss needs a reference model but none was built")
        attach_reference_logps(reference_chunks, micro_batches, seq_length)
    step = partial(_policy_forward_step, loss_fn)
    if forward_only:
        with torch.no_grad():
            store = _run_schedule(step, policy_chunks, micro_batches, seq_length, True)
    else:
        store = _run_schedule(step, policy_chunks, micro_batches, seq_length, False)
    per_pair, metrics, count = ({}, None, 0)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        per_pair, metrics, count = _reduce_per_pair(store)
    metrics, count = _share_from_last_stage((metrics, count))
    return StepOutput(metrics=metrics, num_pairs=count, per_pair=per_pair)


def step_is_finite(loss: float, policy_chunks: list) -> bool:
    """False when the step's loss or any gradient is NaN/Inf, on every rank alike.

    Checks each rank's DDP gradient buffers (after the data-parallel reduction, before the
    optimizer reads them) and all-reduces the verdict over the world, so every rank skips the
    same step. A NaN/Inf anywhere in a rank's buffer would reach the global gradient norm.
    """
    bad = 0.0 if math.isfinite(loss) else 1.0
    if not bad:
        for chunk in policy_chunks:
            for buffer in getattr(chunk, "buffers", []):
                if not bool(torch.isfinite(buffer.grad_data).all()):
                    bad = 1.0
                    break
    flag = torch.tensor([bad])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def train_step(policy_chunks, reference_chunks, optimizer, scheduler, micro_batches,
               seq_length, loss_fn, reference_attached: bool = False) -> StepOutput:
    """One optimizer step: zero grads, forward+backward over the micro-batches, clip, update.

    The optimizer is megatron-core's (distributed) optimizer; ``scheduler`` its
    ``OptimizerParamScheduler`` stepped once per optimizer step.
    """
    for chunk in policy_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    out = dpo_forward_backward(policy_chunks, reference_chunks, micro_batches, seq_length,
                               loss_fn, reference_attached=reference_attached)
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
