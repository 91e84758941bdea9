"""megatron-core's pipeline schedule run over a list of micro-batches, and the last stage's
results shared with the rest of the pipeline: the two pieces every pipeline pass of the engine
uses (a DPO step, the reference pass, evaluation, generation). Nothing here knows what the
micro-batches hold."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from dpo_megatron.parallel.device import get_device


def _iterators(micro_batches: list, num_chunks: int):
    """One iterator per model chunk (the interleaved schedule pulls from each separately)."""
    its = [iter(micro_batches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]


def run_schedule(
    forward_step_func, chunks, micro_batches: list, rows: int, seq_length: int, forward_only: bool
):
    """megatron-core's forward-backward function over ``micro_batches`` (one per chunk stream).

    Under the interleaved (virtual) pipeline megatron-core needs the micro-batch count to be a
    multiple of the pipeline size. A training step's count is checked by the config; a forward-
    only call (evaluation's smaller last step, the reference precompute pass, a decode step) is
    padded with copies of its last micro-batch, whose outputs are dropped.

    Args:
        rows: model rows per micro-batch (R: 2B sequences when padded). The schedule sizes its
            p2p buffers from it, so it is rows, not pairs.
        seq_length: L, tokens per row.
        forward_only: no backward; the chunks run in eval mode (no dropout: reference passes,
            evaluation and sampling compute the deterministic model, as Megatron-LM's evaluate).

    Returns:
        The schedule's forward data store, one entry per given micro-batch (last stage only).
    """
    count = len(micro_batches)
    padding = _interleaved_padding(count, len(chunks)) if forward_only else 0
    padded = list(micro_batches) + [micro_batches[-1]] * padding
    with eval_mode(chunks) if forward_only else contextlib.nullcontext():
        store = get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=_iterators(padded, len(chunks)),
            model=chunks,
            num_microbatches=len(padded),
            seq_length=seq_length,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
    return store[:count]


def _interleaved_padding(count: int, num_chunks: int) -> int:
    """Micro-batches to add so that ``count`` suits the interleaved schedule (0 without it)."""
    if num_chunks == 1:
        return 0
    return -count % parallel_state.get_pipeline_model_parallel_world_size()


@contextlib.contextmanager
def eval_mode(chunks: list):
    """The chunks in eval mode within the block, their previous mode restored after. A chunk
    already in eval mode is left alone (switching walks every module: about 10 ms for a
    30-layer model, at every decode step of a generation)."""
    switched = [chunk for chunk in chunks if chunk.training]
    for chunk in switched:
        chunk.eval()
    try:
        yield
    finally:
        for chunk in switched:
            chunk.train(True)


def share_from_last_stage(payload: Any) -> Any:
    """Broadcast a Python object from the last pipeline stage to the whole pipeline group."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
        device=get_device(),
    )
    return box[0]
