"""Batched generation from the policy chunks at any TP x PP (x VPP) x DP (x EP) layout, with a
KV cache.

:func:`generate` is collective over the world. The completions (prompt i, sample j) are dealt to
the data-parallel ranks longest prompt first, in contiguous equal shares, each share cut into
micro-batches of ``micro_batch_size`` rows (filled up with idle rows, so every rank runs the same
calls: expert parallelism exchanges tokens across data-parallel ranks). Each micro-batch has its
own :class:`~dpo_megatron.models.kv_cache.KVCache`, kept by the layers' core attention:

1. prefill: each micro-batch's prompts, left-padded to its longest in the cache (every row then
   appends at the same cache slots), positions counted from 0 at each row's first token, padding
   slots never a key, go through megatron-core's forward-only pipeline schedule once (one call
   per micro-batch, each at its own length). Only their real tokens are computed, packed into
   one row, and a prefix several rows share (a prompt's samples, a chat template's system turn)
   only once (``generation.prefix_tree``, ``KVCache.append_packed``); under sequence
   parallelism, whose rows split along the sequence, the left-padded rows themselves;
2. decode: one slot per row (x TP under sequence parallelism, the extra slots idle) per step,
   through the same schedule, until every completion of the world has stopped. On the CPU, a
   model the direct loop covers (one chunk per rank, dense pre-norm layers:
   :mod:`dpo_megatron.generation.direct_decode`) decodes through that loop instead: the same
   operations on the same operands, bit for bit, without megatron-core's per-module costs, and
   the rows of all its micro-batches through each product together.

On the CPU the linear layers multiply with weights packed once per call for oneDNN
(``compat.onednn_inference_linear``): a decode step's products of a few rows are then about
twice as fast as MKL's, which packs every weight again at every product. A decode step's other
costs are per operation, not per token: the model's forward runs without the CUDA redirection
mode (``compat.cuda_on_cpu.suspended``), the chunks switch to eval mode once per call, and a
single process takes no collective to know whether a completion is still going.

On the last stage only the last position of each row meets the LM head (``output_index``); its
[rows, V/TP] logits are gathered over the tensor-parallel group and the next tokens chosen on
the host (:mod:`dpo_megatron.generation.sampling`: each completion's own random stream), then
shared with the other pipeline stages, which feed them to the first stage's next step. The
results of the data-parallel ranks are gathered at the end: every rank returns every completion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from dpo_megatron.compat import cuda_on_cpu
from dpo_megatron.compat.onednn_inference_linear import packed_linears
from dpo_megatron.data.batch import PackedLayout
from dpo_megatron.generation.direct_decode import DirectDecoder, unsupported
from dpo_megatron.generation.prefix_tree import pack_prompts
from dpo_megatron.generation.sampling import SamplingParams, choose_tokens, completion_generator
from dpo_megatron.models.attention import packed_seq_params
from dpo_megatron.models.kv_cache import KVCache
from dpo_megatron.parallel.device import get_device, is_host, to_device
from dpo_megatron.parallel.schedule import eval_mode, run_schedule, share_from_last_stage
from dpo_megatron.utils.modules import unwrap


class _MicroBatch:
    """One micro-batch of completions: its rows' (prompt, sample) keys (None: an idle row), its
    prefill length (its longest prompt, rounded up to ``slots``), its cache (room for the
    prefill and ``max_new_tokens - 1`` decode steps of ``slots`` slots), what has been
    generated, and on the last stage each row's random stream."""

    def __init__(self, keys: list, prompts: Sequence[Sequence[int]], slots: int, params):
        self.keys = keys
        self.prompt_lengths = [len(prompts[k[0]]) if k else 0 for k in keys]
        self.length = -(-max(max(self.prompt_lengths), 1) // slots) * slots
        capacity = self.length + (params.max_new_tokens - 1) * slots
        self.cache = KVCache.create(len(keys), capacity, get_device())
        self.generated: list[list[int]] = [[] for _ in keys]
        self.done = [k is None for k in keys]
        self.generators = (
            [completion_generator(params.seed, *k) if k else None for k in keys]
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            else []
        )

    def live(self) -> bool:
        return not all(self.done)


def _check_layout() -> None:
    """Refuse a layout the cache cannot serve (one line naming the setting)."""
    if parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError(
            "generation does not run under context parallelism: set "
            "parallel.context_parallel_size=1"
        )


def _deal(num_items: int, micro_batch_size: int) -> list[list[int | None]]:
    """This data-parallel rank's micro-batches of item indices (None: idle row): a contiguous
    share of ``ceil(num_items / DP)`` items, in micro-batches of ``min(micro_batch_size,
    share)`` rows; every rank gets the same number of micro-batches and rows."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    share = -(-num_items // dp)
    rows = min(micro_batch_size, share)
    count = -(-share // rows)
    mine: list[int | None] = list(range(rank * share, min((rank + 1) * share, num_items)))
    mine += [None] * (count * rows - len(mine))
    return [mine[i * rows : (i + 1) * rows] for i in range(count)]


def _forward_step(data_iterator, model):
    tokens, positions, output_index, cache = next(data_iterator)

    def last_logits(logits):  # [1, R, V/TP] on the last stage
        full = gather_from_tensor_model_parallel_region(logits)[0]
        zero = torch.tensor(0, dtype=torch.int, device=get_device())
        return logits.new_zeros(()), zero, {"logits": full.float().cpu()}

    with cuda_on_cpu.suspended():  # a forward makes no CUDA request the CPU must answer
        output = model(tokens, positions, output_index=output_index, kv_cache=cache)
    return output, last_logits


def _run(chunks, batches: list[_MicroBatch], feeds: list, params, vocab: int, direct=None):
    """One forward of every micro-batch (``feeds``: host tokens, positions and the flat
    positions whose logits choose each row's next token, all of one shape; the caches already
    appended), then the next token of every live row, shared along the pipeline. A decode
    step with ``direct`` (a :class:`DirectDecoder`) computes the logits with it instead of
    the schedule."""
    rows, n = feeds[0][0].shape
    feed = [(*(to_device(t) for t in tensors), mb.cache) for mb, tensors in zip(batches, feeds)]
    if direct is not None:
        with cuda_on_cpu.suspended():
            logits = direct.logits([(t[:, 0], p[:, 0], c) for t, p, _, c in feed])
            store = [{"logits": out.float()} for out in logits]
    else:
        store = run_schedule(_forward_step, chunks, feed, rows, n, True)
    chosen = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        chosen = []
        for mb, out in zip(batches, store):
            live = [r for r, done in enumerate(mb.done) if not done]
            picked = (
                choose_tokens(out["logits"][live, :vocab], params, [mb.generators[r] for r in live])
                if live
                else []
            )
            chosen.append(dict(zip(live, picked)))
    chosen = share_from_last_stage(chosen)
    for mb, picked in zip(batches, chosen):
        for r, token in picked.items():
            mb.generated[r].append(token)
            mb.done[r] = token in params.stop_ids or len(mb.generated[r]) >= params.max_new_tokens


def _prefill_inputs(mb: _MicroBatch, prompts, length: int, pad_id: int):
    """Host [R, length] tokens, positions and real flags of the prompts, left-padded."""
    tokens = torch.full((len(mb.keys), length), pad_id, dtype=torch.int64)
    positions = torch.zeros_like(tokens)
    real = torch.zeros(tokens.shape, dtype=torch.bool)
    for r, key in enumerate(mb.keys):
        if key is None:
            continue
        n = mb.prompt_lengths[r]
        tokens[r, length - n :] = torch.tensor(list(prompts[key[0]]), dtype=torch.int64)
        positions[r, length - n :] = torch.arange(n)
        real[r, length - n :] = True
    return tokens, positions, real


def _prefill_feed(mb: _MicroBatch, prompts, pad_id: int, packed: bool):
    """Append the prompts' slots to ``mb``'s cache; the prefill's host tokens, positions and
    output index: packed ([1, T], each prefix the rows share once, each node of the prompts'
    tree one causal span: ``generation.prefix_tree``; the output index each row's last token,
    an idle row's 0) or, without ``packed`` or without any prompt (a rank's idle micro-batch),
    the left-padded [R, length] rows."""
    tokens, positions, real = _prefill_inputs(mb, prompts, mb.length, pad_id)
    rows, length = tokens.shape
    if not packed or not real.any():
        mb.cache.append(to_device(positions), to_device(real))
        return tokens, positions, torch.arange(rows) * length + length - 1
    tree = pack_prompts([prompts[k[0]] if k else None for k in mb.keys])
    # The spans hold the tree; the segment ids only name each tree (a dense mask of a cached
    # prefill is built from the spans: models.attention.span_visible_keys).
    layout = PackedLayout.from_spans(tree.unit_ids[None], None, tree.spans).to_device()
    shared = tree.tokens.numel() < tree.token_index.numel()
    mb.cache.append_packed(
        to_device(positions),
        to_device(real),
        packed_seq_params(layout, False),
        to_device(tree.token_index) if shared else None,
    )
    return tree.tokens[None], tree.positions[None], tree.last


def _decode_feed(mb: _MicroBatch, slots: int, pad_id: int):
    """Append one decode step's slots to ``mb``'s cache; its host [R, slots] tokens and
    positions (each live row's last token in slot 0 at its position, the other slots idle:
    sequence parallelism) and output index (slot 0 of each row)."""
    tokens = torch.full((len(mb.keys), slots), pad_id, dtype=torch.int64)
    positions = torch.zeros_like(tokens)
    real = torch.zeros(tokens.shape, dtype=torch.bool)
    for r, out in enumerate(mb.generated):
        if not mb.done[r]:
            tokens[r, 0] = out[-1]
            positions[r, 0] = mb.prompt_lengths[r] + len(out) - 1
            real[r, 0] = True
    mb.cache.append(to_device(positions), to_device(real))
    return tokens, positions, torch.arange(len(mb.keys)) * slots


def _any_live(batches: list[_MicroBatch]) -> bool:
    """Whether a completion anywhere in the world is still generating (collective): every rank
    then takes the same number of steps."""
    live = any(mb.live() for mb in batches)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return live
    flag = torch.tensor([float(live)], device=get_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def generate(
    chunks: list,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    num_samples: int = 1,
    micro_batch_size: int,
    pad_id: int,
    vocab_size: int,
) -> list[list[list[int]]]:
    """Sample ``num_samples`` completions of every prompt (collective over the world).

    Args:
        chunks: this rank's policy chunks (``build_model_chunks``; DDP-wrapped ones too).
        prompts: token ids of each prompt, the same full list on every rank (none empty).
        params: temperature, top-p, ``max_new_tokens``, seed, stop ids.
        num_samples: completions per prompt.
        micro_batch_size: completions per micro-batch (rows of one pipeline pass).
        pad_id: token id written into padding slots (never attended to).
        vocab_size: the tokenizer's vocabulary; ids at or above it (the model's padding
            columns) are never chosen.

    Returns:
        For each prompt in input order, its ``num_samples`` completions: generated token ids,
        prompt excluded, the stop token kept; identical on every rank. Completion (i, j) depends
        on ``params.seed``, i and j only, whatever the layout or batching (up to fp32 rounding
        of the logits).

    Raises:
        ValueError: an empty prompt, a prompt that with ``max_new_tokens`` needs more positions
            than the model has (its ``max_position_embeddings``), a count below 1, or context
            parallelism.
    """
    if num_samples < 1 or micro_batch_size < 1:
        raise ValueError(
            f"num_samples and micro_batch_size must be >= 1, got {num_samples}, {micro_batch_size}"
        )
    # The last token generated is never fed back: a completion uses len(prompt) +
    # max_new_tokens - 1 positions.
    positions = getattr(unwrap(chunks[0]), "max_sequence_length", None) if chunks else None
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: generation needs at least one token")
        if positions is not None and len(prompt) + params.max_new_tokens - 1 > positions:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens: with max_new_tokens="
                f"{params.max_new_tokens} it needs {len(prompt) + params.max_new_tokens - 1} "
                f"positions, more than the model's {positions} (max_position_embeddings)"
            )
    if not prompts:
        return []
    _check_layout()
    config = chunks[0].config
    slots = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    # Longest prompts first: a micro-batch holds prompts of similar lengths, so little padding.
    keys = sorted(
        ((i, j) for i in range(len(prompts)) for j in range(num_samples)),
        key=lambda key: -len(prompts[key[0]]),
    )
    batches = [
        _MicroBatch([None if k is None else keys[k] for k in indices], prompts, slots, params)
        for indices in _deal(len(keys), micro_batch_size)
    ]
    # eval mode once for the call, not at every schedule call (each walks every module)
    with eval_mode(chunks), packed_linears(chunks) if is_host() else contextlib.nullcontext():
        # Prefill one micro-batch per schedule call, each at its own length (every data-parallel
        # rank makes as many calls, in the same order: expert parallelism pairs their forwards).
        for mb in batches:
            feed = _prefill_feed(mb, prompts, pad_id, packed=slots == 1)
            _run(chunks, [mb], [feed], params, vocab_size)
        direct = DirectDecoder(chunks[0]) if unsupported(chunks) is None else None
        while _any_live(batches):
            feeds = [_decode_feed(mb, slots, pad_id) for mb in batches]
            _run(chunks, batches, feeds, params, vocab_size, direct)
    mine = [(k, out) for mb in batches for k, out in zip(mb.keys, mb.generated) if k is not None]
    parts = [mine]
    if parallel_state.get_data_parallel_world_size() > 1:
        parts = [None] * parallel_state.get_data_parallel_world_size()
        dist.all_gather_object(parts, mine, group=parallel_state.get_data_parallel_group())
    results: list[list[list[int]]] = [[[] for _ in range(num_samples)] for _ in prompts]
    for part in parts:
        for (i, j), out in part:
            results[i][j] = out
    return results
