"""Where the reference log-probs of a step come from: the frozen model, or a precomputed table.

DPO's loss needs log pi_ref(y|x) for chosen and rejected (Rafailov et al. 2023, eq. 7). The
reference never changes, so running it every step costs one forward per pair per epoch that can
be paid once:

* ``reference.mode=model`` (default): the frozen reference runs forward-only through the pipeline
  schedule each step (``training.step.attach_reference_logps``).
* ``reference.mode=precomputed``: one forward-only pass over the whole training set before the
  first step stores each pair's per-token completion log-probs (a table of
  ``len(chosen) + len(rejected)`` fp32 values per pair), cached on disk under a key made of the
  model's weights identity, the tokenized pairs themselves and the format version; training
  steps then run no reference forward at all, and the reference model can be dropped.
* ``reference.offload=true`` (with ``model``): the reference weights live in host memory (pinned
  on CUDA) and are copied to the accelerator only for the reference pass, so policy activations
  and optimizer state get the memory between passes. On a CPU-only machine host and device are the
  same and the swap is a no-op.

Per-token values are kept (not per-sequence sums) so that losses that weight reference tokens
(LD-DPO) see exactly what ``model`` mode gives them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dpo_megatron.data.pairs import PreferencePair

REFERENCE_MODES = ("model", "precomputed")
CACHE_VERSION = 1


@dataclass
class ReferenceConfig:
    """How the reference log-probs are obtained (``reference.*``)."""

    mode: str = "model"
    """'model': the frozen reference runs forward every step. 'precomputed': one forward-only pass
    over the training pairs before training, cached on disk; no reference forward while
    training (same loss as 'model', fp32 1e-5)."""
    offload: bool = False
    """Keep the reference weights in host memory and copy them to the accelerator only for the
    reference pass (mode 'model'; also used for the precompute pass)."""
    cache_dir: str = ""
    """Directory of precomputed tables (empty: <DPO_MEGATRON_CACHE>/reference_logps). Must be
    shared by all ranks of a multi-node run (like checkpoint directories)."""
    micro_batch_size: int = 0
    """Pairs per micro-batch of the precompute pass (0: train.micro_batch_size)."""

    def validate(self) -> None:
        """Raises ValueError for an unknown mode or a negative micro-batch size."""
        if self.mode not in REFERENCE_MODES:
            raise ValueError(f"reference.mode={self.mode!r}; known: {', '.join(REFERENCE_MODES)}")
        if self.micro_batch_size < 0:
            raise ValueError(f"reference.micro_batch_size={self.micro_batch_size} must be >= 0")


@dataclass
class ReferenceTable:
    """Per-pair reference log-probs of the completion tokens (nats, fp32).

    ``chosen[i]`` has ``len(pairs[i].chosen_ids)`` values: log pi_ref(chosen_t | prompt,
    chosen_<t); likewise ``rejected[i]``.
    """

    chosen: list[torch.Tensor]
    rejected: list[torch.Tensor]

    def save(self, path: Path) -> None:
        """Atomic write (temp file + rename): concurrent readers see all or nothing."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        lengths = torch.tensor([[len(c), len(r)] for c, r in zip(self.chosen, self.rejected)])
        flat = torch.cat([t for pair in zip(self.chosen, self.rejected) for t in pair])
        torch.save({"version": CACHE_VERSION, "lengths": lengths, "values": flat}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "ReferenceTable":
        """Raises ValueError for a file of another format version."""
        blob = torch.load(path, weights_only=True)
        if blob.get("version") != CACHE_VERSION:
            raise ValueError(f"{path}: reference table version {blob.get('version')}, "
                             f"expected {CACHE_VERSION}; delete it to recompute")
        sizes = blob["lengths"].reshape(-1).tolist()
        parts = torch.split(blob["values"], sizes)
        return cls(list(parts[0::2]), list(parts[1::2]))


def pairs_fingerprint(pairs: Sequence[PreferencePair]) -> str:
    """sha256 of the tokenized pairs in order: covers the data, the tokenizer, the chat template
    and every length rule at once (whatever changes a token changes the key)."""
    h = hashlib.sha256()
    for p in pairs:
        for ids in (p.prompt_ids, p.chosen_ids, p.rejected_ids):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _files_identity(folder: str) -> list:
    """(name, size, mtime_ns) of the weight files of a folder (HF or distributed checkpoint)."""
    root = Path(folder)
    if root.is_file():
        stat = root.stat()
        return [[root.name, stat.st_size, stat.st_mtime_ns]]
    out = []
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".bin", ".pt", ".distcp", ".json"):
            stat = f.stat()
            out.append([str(f.relative_to(root)), stat.st_size, stat.st_mtime_ns])
    return out


def reference_cache_key(pairs: Sequence[PreferencePair], model_config, seed: int) -> str:
    """Key of a precomputed table: model architecture + weight files (or seed when randomly
    initialised) + the tokenized pairs + the table format version."""
    model = asdict(model_config) if is_dataclass(model_config) else dict(model_config)
    weights = model.get("load") or model.get("hf_path")
    key = {
        "version": CACHE_VERSION,
        "model": model,
        "weights": _files_identity(weights) if weights else {"random_init_seed": seed},
        "pairs": pairs_fingerprint(pairs),
        "dtype": str(torch.get_default_dtype()),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _cache_path(cfg: ReferenceConfig, key: str) -> Path:
    if cfg.cache_dir:
        root = Path(cfg.cache_dir).expanduser()
    else:
        from dpo_megatron.assets import cache_root

        root = cache_root() / "reference_logps"
    return root / f"reference-{key[:32]}.pt"


# ----------------------------------------------------------------------------------------------
# offload


def move_chunks(chunks: list, device: torch.device) -> None:
    """Move parameters and buffers of model chunks to ``device`` in place (pinned host memory
    when moving to the CPU of a CUDA machine, so the next copy back is asynchronous)."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    with torch.no_grad():
        for chunk in chunks:
            for t in list(chunk.parameters()) + list(chunk.buffers()):
                if t.device != device:
                    moved = t.data.to(device, non_blocking=True)
                    t.data = moved.pin_memory() if pin else moved


def _compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# precompute


def _completion_values(token_logps: torch.Tensor, loss_mask: torch.Tensor) -> list[torch.Tensor]:
    """[2B, S] per-token values -> the 2B rows' completion values (mask order, fp32, CPU)."""
    return [row[m.bool()].float().cpu() for row, m in zip(token_logps, loss_mask)]


@torch.no_grad()
def precompute_reference_logps(reference_chunks: list, pairs: Sequence[PreferencePair],
                               pad_token_id: int, multiple: int, micro_batch_size: int,
                               packed: bool = False) -> Optional[ReferenceTable]:
    """One forward-only pass of the reference over all pairs (split over data-parallel ranks).

    Collective over the whole world. Returns the full table on last-pipeline-stage ranks, None on
    the others (they never read reference log-probs).
    """
    from megatron.core import parallel_state

    from dpo_megatron.training.batches import build_micro_batches
    from dpo_megatron.training.step import attach_reference_logps

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    per_rank = -(-len(pairs) // dp)
    mine = list(range(rank * per_rank, min(len(pairs), (rank + 1) * per_rank)))
    # Every DP rank must run the same number of schedule calls: pad with repeats of pair 0.
    batches = -(-per_rank // micro_batch_size)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in range(batches):
        idx = mine[b * micro_batch_size:(b + 1) * micro_batch_size] or [0]
        if packed:
            from dpo_megatron.data.packing import build_packed_micro_batches

            mbs, seq_length, _ = build_packed_micro_batches(pairs, [idx], pad_token_id, multiple)
        else:
            mbs, seq_length, _ = build_micro_batches(pairs, [idx], pad_token_id, multiple)
        attach_reference_logps(reference_chunks, mbs, seq_length)
        if last:
            rows = _completion_values(mbs[0]["reference_token_logps"], mbs[0]["loss_mask"])
            for k, i in enumerate(idx):
                values[i] = (rows[k], rows[len(idx) + k])
    gathered = [None] * dp
    dist.all_gather_object(gathered, values if last else None,
                           group=parallel_state.get_data_parallel_group())
    if not last:
        return None
    merged = {i: v for part in gathered for i, v in part.items()}
    return ReferenceTable([merged[i][0] for i in range(len(pairs))],
                          [merged[i][1] for i in range(len(pairs))])


def load_or_precompute(cfg: ReferenceConfig, reference_chunks: list, pairs: Sequence[PreferencePair],
                       pad_token_id: int, multiple: int, micro_batch_size: int, model_config,
                       seed: int, packed: bool = False) -> tuple[Optional[ReferenceTable], str]:
    """The cached table if every rank finds it, else precompute and write it (global rank 0 of
    the writers: last stage, TP rank 0, DP rank 0). Returns (table or None off the last stage,
    "hit" or "computed")."""
    from megatron.core import parallel_state

    path = _cache_path(cfg, reference_cache_key(pairs, model_config, seed))
    found = torch.tensor([1 if path.is_file() else 0], dtype=torch.int32)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if found.item():
        return (ReferenceTable.load(path) if last else None), "hit"
    if cfg.offload:
        move_chunks(reference_chunks, _compute_device())
    table = precompute_reference_logps(reference_chunks, pairs, pad_token_id, multiple,
                                       cfg.micro_batch_size or micro_batch_size, packed)
    if cfg.offload:
        move_chunks(reference_chunks, torch.device("cpu"))
    writer = (last and parallel_state.get_tensor_model_parallel_rank() == 0
              and parallel_state.get_data_parallel_rank() == 0)
    if writer:
        table.save(path)
    dist.barrier()
    return table, "computed"


def attach_precomputed(micro_batches: list[dict], micro_batch_indices: list[list[int]],
                       table: Optional[ReferenceTable]) -> None:
    """Fill ``reference_token_logps`` [2B, S] of each micro-batch from the table, at its
    ``loss_mask`` positions (padded layout; packed batches carry that layout too). No-op off the
    last stage (``table`` None).

    Raises:
        ValueError: a table row whose length differs from the pair's completion (stale table).
    """
    if table is None:
        return
    for batch, idx in zip(micro_batches, micro_batch_indices):
        mask = batch["loss_mask"].bool()
        rows = [table.chosen[i] for i in idx] + [table.rejected[i] for i in idx]
        counts = mask.sum(-1).tolist()
        for k, (row, n) in enumerate(zip(rows, counts)):
            if row.numel() != n:
                raise ValueError(f"precomputed reference row {k} of pairs {idx} has {row.numel()} "
                                 f"values for {n} completion tokens: the table is stale")
        ref = torch.zeros_like(batch["loss_mask"])
        ref[mask] = torch.cat(rows).to(ref.device, ref.dtype)
        batch["reference_token_logps"] = ref


class ReferenceSource:
    """Gives each step its reference log-probs according to ``reference.*``.

    ``attach(micro_batches, micro_batch_indices, seq_length)`` runs on every rank before the
    policy pass and stores ``reference_token_logps`` in the last stage's micro-batches; the step
    is then told they are attached (``reference_attached=True``) and runs no reference pass.
    """

    def __init__(self, cfg: ReferenceConfig, reference_chunks: Optional[list],
                 table: Optional[ReferenceTable] = None):
        cfg.validate()
        self.cfg = cfg
        self.chunks = reference_chunks
        self.table = table
        if cfg.mode == "model" and cfg.offload and reference_chunks is not None:
            move_chunks(reference_chunks, torch.device("cpu"))

    def attach(self, micro_batches: list[dict], micro_batch_indices: list[list[int]],
               seq_length: int) -> None:
        """Attach this step's reference log-probs (collective over the pipeline in 'model')."""
        if self.cfg.mode == "precomputed":
            attach_precomputed(micro_batches, micro_batch_indices, self.table)
            return
        from dpo_megatron.training.step import attach_reference_logps

        if self.cfg.offload:
            move_chunks(self.chunks, _compute_device())
        attach_reference_logps(self.chunks, micro_batches, seq_length)
        if self.cfg.offload:
            move_chunks(self.chunks, torch.device("cpu"))


def build_reference_source(cfg: ReferenceConfig, reference_chunks: Optional[list],
                           pairs: Sequence[PreferencePair], pad_token_id: int, multiple: int,
                           micro_batch_size: int, model_config, seed: int,
                           packed: bool = False) -> ReferenceSource:
    """The run's ReferenceSource; in 'precomputed' mode the table is loaded or computed here
    (collective), printing on rank 0 whether the cache was hit."""
    cfg.validate()
    if cfg.mode == "model":
        return ReferenceSource(cfg, reference_chunks)
    table, how = load_or_precompute(cfg, reference_chunks, pairs, pad_token_id, multiple,
                                    micro_batch_size, model_config, seed, packed)
    if dist.get_rank() == 0:
        print(f"reference log-probs of {len(pairs)} pairs: {how} "
              f"({'cache' if how == 'hit' else 'one forward-only pass'})", flush=True)
    return ReferenceSource(cfg, reference_chunks, table)
