"""Where the reference log-probs come from: the frozen model each step, or a table computed once.

DPO's loss needs log pi_ref(y|x) for chosen and rejected (Rafailov et al. 2023, eq. 7). The
reference never changes, so running it every step costs one forward per pair per epoch that can
be paid once:

* ``reference.mode=model``: the frozen :class:`ReferenceModel` runs forward-only
  through the pipeline schedule each step (``training.step.reference_token_logps``);
  ``reference.offload=true`` keeps its weights in host memory between passes (pinned on CUDA;
  a no-op on the CPU, where host and device are the same). With LoRA (``lora.enabled``) the
  reference is :class:`BaseModelReference`: the policy's own chunks with their adapters
  bypassed, so no second copy of the weights exists.
* ``reference.mode=precomputed``: one forward-only pass over the training *and* eval pairs before
  the first step stores each pair's per-token completion log-probs in a table (cached on disk,
  keyed by a fingerprint of the reference weights, the layout, the tokenized pairs, their
  grouping and the format version). The pass groups the pairs as the first epoch and the
  evaluation do (:func:`precompute_plan`), so the values are ``model`` mode's bit for bit. They
  then travel with the pairs (``PreferencePair.reference_*_logps`` -> the micro-batch's
  targets' ``reference_logps``), no reference forward runs while training or evaluating, and the
  reference model is freed.

The reference is the policy's starting weights, or with ``reference.hf_path`` /
``reference.load`` weights of its own (``training.run_models.build_reference``).

Per-token values are kept (not per-sequence sums) so that losses that weight reference tokens
(LD-DPO) see exactly what ``model`` mode gives them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dpo_megatron.data.batch import BatchBuilder
from dpo_megatron.data.pairs import PreferencePair
from dpo_megatron.parallel.device import get_device, is_cuda
from dpo_megatron.parallel.layout import is_stage_writer
from dpo_megatron.training.config import ReferenceConfig
from dpo_megatron.utils import ranks
from dpo_megatron.utils.cache import CACHE_VERSION, cache_root, content_key
from dpo_megatron.utils.files import atomic_file
from dpo_megatron.utils.modules import unwrap


@dataclass
class ReferenceTable:
    """Per-pair reference log-probs of the completion tokens (nats, fp32, host).

    ``chosen[i]`` has ``len(pairs[i].chosen_ids)`` values: log pi_ref(chosen_t | prompt,
    chosen_<t); likewise ``rejected[i]``.
    """

    chosen: list[torch.Tensor]
    rejected: list[torch.Tensor]

    def save(self, path: Path) -> None:
        """Atomic write (temp file + rename): concurrent readers see all or nothing."""
        lengths = torch.tensor([[len(c), len(r)] for c, r in zip(self.chosen, self.rejected)])
        flat = torch.cat([t for pair in zip(self.chosen, self.rejected) for t in pair])
        with atomic_file(path) as tmp:
            torch.save({"version": CACHE_VERSION, "lengths": lengths, "values": flat}, tmp)

    @classmethod
    def load(cls, path: Path) -> ReferenceTable:
        """Raises ValueError for a file of another format version."""
        blob = torch.load(path, weights_only=True)
        if blob.get("version") != CACHE_VERSION:
            raise ValueError(
                f"{path}: reference table version {blob.get('version')}, "
                f"expected {CACHE_VERSION}; delete it to recompute"
            )
        sizes = blob["lengths"].reshape(-1).tolist()
        parts = torch.split(blob["values"], sizes)
        return cls(list(parts[0::2]), list(parts[1::2]))

    def attach(self, pairs: Sequence[PreferencePair]) -> list[PreferencePair]:
        """The pairs, each carrying its reference log-probs.

        Raises:
            ValueError: a table of another size, or a row whose length differs from its
                completion's (a stale table).
        """
        if len(self.chosen) != len(pairs):
            raise ValueError(
                f"reference table has {len(self.chosen)} pairs, the data "
                f"{len(pairs)}: the table is stale"
            )
        out = []
        for i, (p, c, r) in enumerate(zip(pairs, self.chosen, self.rejected)):
            if c.numel() != len(p.chosen_ids) or r.numel() != len(p.rejected_ids):
                raise ValueError(
                    f"reference table row {i} has {c.numel()}/{r.numel()} values for "
                    f"{len(p.chosen_ids)}/{len(p.rejected_ids)} completion tokens: "
                    "the table is stale"
                )
            out.append(dataclasses.replace(p, reference_chosen_logps=c, reference_rejected_logps=r))
        return out


def pairs_fingerprint(pairs: Sequence[PreferencePair]) -> str:
    """sha256 of the tokenized pairs in order: covers the data, the tokenizer, the chat template
    and every length rule at once (whatever changes a token changes the key)."""
    h = hashlib.sha256()
    for p in pairs:
        for ids in (p.prompt_ids, p.chosen_ids, p.rejected_ids):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


_FINGERPRINT_CHUNK = 1 << 22
"""Elements of a parameter reduced at a time (bounds the fp64 copy to 32 MiB)."""


def _tensor_stats(x: torch.Tensor) -> torch.Tensor:
    """[3] float64: sum, sum of squares and index-weighted sum of a flat tensor (in chunks)."""
    out = torch.zeros(3, dtype=torch.float64, device=x.device)
    for s in range(0, x.numel(), _FINGERPRINT_CHUNK):
        c = x[s : s + _FINGERPRINT_CHUNK].double()
        ramp = torch.arange(s, s + c.numel(), dtype=torch.float64, device=x.device)
        out += torch.stack([c.sum(), (c * c).sum(), (c * ramp).sum()])
    return out


@torch.no_grad()
def weights_fingerprint(chunks: list) -> str:
    """A fingerprint of the model's actual weights, the same on every rank (collective).

    Only frozen parameters count: they are the reference's weights (all of a
    :class:`ReferenceModel`'s; the base weights of a LoRA policy, whose trainable adapters are
    bypassed in the reference pass), so a LoRA run and a full run on the same base share a table.

    Each rank reduces each of its parameter shards to three float64 numbers (sum, sum of
    squares, an index-weighted sum) on the device; the numbers of all ranks are gathered and
    hashed in global rank order. Identical weights at the identical layout give the identical
    fingerprint; any change of a value, of the layout or of the seed that drew random weights
    gives another. (megatron-core draws random weights per pipeline stage, so they depend on
    the layout: a layout-independent key would wrongly share tables between layouts.)

    The parameters' dtypes count too: a bf16 checkpoint's values are the same numbers in an fp32
    and a bf16 model (``model.params_dtype=auto`` is either, by device), but the forward rounds
    differently, and a table of one is not the other's reference to the bit.
    """
    frozen = [
        p
        for chunk in chunks
        for _, p in sorted(unwrap(chunk).named_parameters())
        if not p.requires_grad
    ]
    stats = [_tensor_stats(p.detach().reshape(-1)) for p in frozen]
    dtypes = ",".join(str(p.dtype) for p in frozen).encode()
    local = dtypes + (torch.cat(stats).cpu().numpy().tobytes() if stats else b"")
    gathered = [local]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    return hashlib.sha256(b"".join(gathered)).hexdigest()


def reference_cache_key(
    pairs: Sequence[PreferencePair],
    model_config,
    weights: str,
    layout: dict,
    grouping: dict | None = None,
) -> str:
    """Key of a precomputed table: everything the reference log-probs depend on, to the bit.

    Args:
        pairs: the tokenized pairs (their fingerprint).
        model_config: the architecture (ModelConfig or a dict).
        weights: :func:`weights_fingerprint` of the reference model.
        layout: the parallel layout (TP, PP, VPP, ...), since the reduction order and, for random
            weights, the weights themselves depend on it. The engine's device type is added
            (its kernels round differently).
        grouping: how the pass grouped the pairs into micro-batches and rows
            (:func:`precompute_plan`'s fingerprint, the packing settings): the last bits of a
            pair's log-probs depend on what shares its micro-batch.
    """
    model = asdict(model_config) if is_dataclass(model_config) else dict(model_config)
    key = {
        "model": model,
        "weights": weights,
        "layout": layout,
        "pairs": pairs_fingerprint(pairs),
        "grouping": grouping or {},
        "dtype": str(torch.get_default_dtype()),
        # the kernels: the same weights give other last bits on a GPU than on the CPU
        "device": get_device().type,
    }
    return content_key(key)


def cache_path(cfg: ReferenceConfig, key: str) -> Path:
    """The table file of ``key`` under ``reference.cache_dir`` (default
    ``<DPO_MEGATRON_CACHE>/reference_logps``)."""
    if cfg.cache_dir:
        root = Path(cfg.cache_dir).expanduser()
    else:
        root = cache_root() / "reference_logps"
    return root / f"reference-{key[:32]}.pt"


# ----------------------------------------------------------------------------------------------
# the frozen model


def release_chunks(chunks: list | None) -> None:
    """Drop a model's parameters and buffers now (the caller drops its own references), and
    hand cached accelerator memory back."""
    import gc

    from dpo_megatron.parallel.device import empty_cache

    for chunk in chunks or []:
        for p in list(chunk.parameters()) + list(chunk.buffers()):
            p.data = p.data.new_empty(0)
    gc.collect()
    empty_cache()


def move_chunks(chunks: list, device: torch.device) -> None:
    """Move parameters and buffers of model chunks to ``device`` in place (pinned host memory
    when moving to the host of a CUDA device, so the next copy back is asynchronous)."""
    pin = device.type == "cpu" and is_cuda()
    with torch.no_grad():
        for chunk in chunks:
            for t in list(chunk.parameters()) + list(chunk.buffers()):
                if t.device != device:
                    moved = t.data.to(device, non_blocking=True)
                    t.data = moved.pin_memory() if pin else moved


class ReferenceModel:
    """The frozen reference chunks (same layout as the policy), optionally offloaded to the host
    between passes (``reference.offload``).

    A reference object has ``chunks`` (whose frozen parameters are the reference weights),
    ``token_logps(batch)`` and ``release()``; the step and the trainer use only these.
    """

    def __init__(self, chunks: list, offload: bool = False):
        self.chunks = chunks
        self.offload = offload and is_cuda()  # on the CPU host and device are one
        if self.offload:
            move_chunks(chunks, torch.device("cpu"))

    def token_logps(self, batch) -> list[torch.Tensor]:
        """The reference's per-token log-probs of ``batch``: on the last pipeline stage one
        [N, S] fp32 tensor per micro-batch, an empty list elsewhere
        (``training.step.reference_token_logps``; collective over the pipeline)."""
        from dpo_megatron.training.step import reference_token_logps

        if self.offload:
            move_chunks(self.chunks, get_device())
        values = reference_token_logps(self.chunks, batch)
        if self.offload:
            move_chunks(self.chunks, torch.device("cpu"))
        return values

    def release(self) -> None:
        """Free the reference weights (``reference.mode=precomputed``, after its pass)."""
        release_chunks(self.chunks)


class BaseModelReference:
    """The reference of a LoRA run: the policy's own chunks with every adapter bypassed.

    LoRA starts from B = 0, so the base model is the step-0 policy, i.e. DPO's reference
    (Rafailov et al. 2023, sec. 4: pi_ref = the initial policy). The reference pass runs the
    same modules forward-only, without gradient and with the adapters off; no copy of the
    weights is built, and none is freed after a precompute pass.
    """

    def __init__(self, chunks: list):
        self.chunks = chunks

    def token_logps(self, batch) -> list[torch.Tensor]:
        """The base model's per-token log-probs of ``batch``, as
        :meth:`ReferenceModel.token_logps` (collective over the pipeline)."""
        from dpo_megatron.models.lora import adapters_disabled
        from dpo_megatron.training.step import reference_token_logps

        with adapters_disabled(self.chunks):
            return reference_token_logps(self.chunks, batch)

    def release(self) -> None:
        """Nothing to free: the weights are the policy's."""


# ----------------------------------------------------------------------------------------------
# precompute


def _completion_values(token_logps: torch.Tensor, loss_mask: torch.Tensor) -> list[torch.Tensor]:
    """[N, S] per-token values -> the N rows' completion values (mask order, fp32, host)."""
    token_logps, loss_mask = token_logps.float().cpu(), loss_mask.bool().cpu()
    return [row[m] for row, m in zip(token_logps, loss_mask)]


Plan = list[list[list[int]]]
"""This data-parallel rank's steps of a pass: each step a list of micro-batches, each a list of
item indices (``ItemSampler.next_step()``'s form); a step is built as one ``StepBatch``."""


def precompute_plan(run_steps: Plan, num_items: int, micro_batch_size: int) -> tuple[Plan, str]:
    """The precompute pass's steps on this rank, and a fingerprint of every rank's (collective
    over the data-parallel group).

    The pass runs ``run_steps`` (the steps training's first epoch or evaluation takes on this
    rank: the reference then sees each of these pairs in the very micro-batches, rows and
    padding the policy sees, so its log-probs are the model-mode reference's bit for bit), then
    the pairs no rank's ``run_steps`` hold (the remainder a dropped last batch leaves out of the
    first epoch), split contiguously over the data-parallel ranks in micro-batches of
    ``micro_batch_size``, one per step.

    Why the grouping matters: a pair's log-probs depend in the last bits on what shares its
    micro-batch (matrix kernels block the token dimension by its size, and packed rows hold other
    pairs), so the same pairs grouped otherwise would give a reference an ulp away from the
    step-0 policy, and step-0 rewards that are float noise instead of 0.

    Returns:
        (this rank's steps, the hex sha256 of all data-parallel ranks' steps in rank order: the
        grouping, part of the table's cache key).
    """
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    plans: list = [None] * dp
    dist.all_gather_object(plans, run_steps, group=group)
    covered = {i for plan in plans for step in plan for mb in step for i in mb}
    missing = [i for i in range(num_items) if i not in covered]
    per_rank = -(-len(missing) // dp)
    mine = missing[rank * per_rank : (rank + 1) * per_rank]
    rest = [[mine[i : i + micro_batch_size]] for i in range(0, len(mine), micro_batch_size)]
    plan = list(run_steps) + rest
    h = hashlib.sha256()
    for other in range(dp):
        other_rest = missing[other * per_rank : (other + 1) * per_rank]
        h.update(repr((plans[other], other_rest, micro_batch_size)).encode())
    return plan, h.hexdigest()


def precompute_reference_logps(
    reference: ReferenceModel,
    pairs: Sequence[PreferencePair],
    builder: BatchBuilder,
    plan: Plan,
) -> ReferenceTable | None:
    """One forward-only pass of the reference over ``plan`` (this data-parallel rank's steps,
    :func:`precompute_plan`; together the ranks' plans hold every pair).

    Every rank runs as many schedule calls as the rank with the most steps (an empty step, or a
    missing one, runs pair 0 and is discarded): expert-parallel groups span data-parallel ranks.
    A pair met twice keeps its first values. Collective over the whole world.

    Returns:
        The full table on last-pipeline-stage ranks, None on the others.
    """
    from megatron.core import parallel_state

    count = torch.tensor([len(plan)], dtype=torch.int64, device=get_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    steps = list(plan) + [[]] * (int(count.item()) - len(plan))
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for micro_batches in steps:
        filler = not any(micro_batches)
        step = builder.build(pairs, [[0]] if filler else micro_batches).to_device()
        token_logps = reference.token_logps(step)
        if not last or filler:
            continue
        for targets, indices, mb_logps in zip(step.targets, step.item_indices, token_logps):
            rows = _completion_values(mb_logps, targets.loss_mask)
            n = len(indices)
            for k, i in enumerate(indices):
                values.setdefault(i, (rows[k], rows[n + k]))
    dp = parallel_state.get_data_parallel_world_size()
    gathered = [None] * dp
    dist.all_gather_object(
        gathered, values if last else None, group=parallel_state.get_data_parallel_group()
    )
    if not last:
        return None
    merged: dict = {}
    for part in gathered:
        for i, v in part.items():
            merged.setdefault(i, v)
    return ReferenceTable(
        [merged[i][0] for i in range(len(pairs))], [merged[i][1] for i in range(len(pairs))]
    )


def _all_ranks_agree(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def precomputed_pairs(
    cfg: ReferenceConfig,
    reference: ReferenceModel,
    pairs: Sequence[PreferencePair],
    builder: BatchBuilder,
    run_steps: Plan,
    micro_batch_size: int,
    model_config,
    layout: dict,
    batching: dict,
    what: str = "train pairs",
) -> list[PreferencePair]:
    """``pairs`` carrying their reference log-probs: from the cache when every rank finds the
    table of these weights, layout, pairs and grouping, else computed (one forward-only pass,
    grouped as :func:`precompute_plan` says) and written by one rank (last stage, TP rank 0, DP
    rank 0); every rank then reads the file (the cache folder must be shared by all ranks, like
    checkpoint folders). Collective.

    Args:
        run_steps: this rank's steps that will read these pairs (training's first epoch, or the
            evaluation's steps); [] to group them only by ``micro_batch_size``.
        micro_batch_size: pairs per micro-batch of the pairs ``run_steps`` leaves out.
        batching: how the builder turns micro-batches into rows (packing settings, row-length
            granule, pad id), part of the cache key with the grouping.
        what: the items as the printed line names them (``train pairs``, ``eval examples``).

    Prints on rank 0 whether the cache was hit.
    """

    if not pairs:
        return list(pairs)
    plan, grouping = precompute_plan(run_steps, len(pairs), micro_batch_size)
    key = reference_cache_key(
        pairs,
        model_config,
        weights_fingerprint(reference.chunks),
        layout,
        {"steps": grouping, **batching},
    )
    path = cache_path(cfg, key)
    hit = _all_ranks_agree(path.is_file())
    if not hit:
        table = precompute_reference_logps(reference, pairs, builder, plan)
        if table is not None and is_stage_writer():
            table.save(path)
        dist.barrier()
    if ranks.is_rank0():
        how = "cache hit" if hit else "computed in one forward-only pass"
        print(f"reference log-probs of {len(pairs)} {what}: {how} ({path})", flush=True)
    return ReferenceTable.load(path).attach(pairs)
