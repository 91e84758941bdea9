"""Export live megatron-core model chunks (any TP x PP x VPP layout) as a Hugging Face folder.

Collective over all ranks. Within each TP group the slices of every parameter are all-gathered
and merged back to HF tensors (:func:`merge_tp_shards`), experts over their expert-TP and
expert-parallel groups as well; the first TP/DP rank of each pipeline
stage then sends its stage's tensors to global rank 0, one stage at a time, and rank 0 writes
sharded safetensors as they arrive (so it holds at most one stage plus one shard in memory).
Rank 0 writes into a temporary folder next to ``out_dir`` and renames it into place at the end:
a failed export leaves no partial folder. The outcome is broadcast so every rank returns or
raises together.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures import REPLICATED, expand
from dpo_megatron.models.conversion.hf_config import hf_config_dict, infer_architecture
from dpo_megatron.models.conversion.hf_files import write_safetensors_shards
from dpo_megatron.models.conversion.load import OUTPUT, iter_global_params, table_entry
from dpo_megatron.models.conversion.tp_split import merge_tp_shards

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
"""Files copied from the tokenizer folder when present."""


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (their ``.module``)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _gather(local: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``local`` (same shape everywhere) in group-rank order."""
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def stage_hf_tensors(chunks: list[torch.nn.Module], cfg: ModelConfig, dtype: torch.dtype,
                     keep: bool = True) -> list[tuple[str, torch.Tensor]]:
    """This rank's pipeline stage as (HF name, full tensor) pairs in ``dtype``, on the CPU.

    Collective over the stage: every TP-split parameter is all-gathered over the TP group (an
    expert's over the expert-TP group), and every expert's merged tensors over the
    expert-parallel group (EP rank k holds experts ``[k * E/EP, (k + 1) * E/EP)``), so the
    stage's first rank has all of them. Ordered by global layer (embedding first, final norm and
    output layer last). ``keep=False``: take part in the collectives, return nothing (ranks that
    do not send).
    """
    arch = infer_architecture(cfg)
    table = {t.megatron: t for t in arch.tensors(cfg)}
    tp = (parallel_state.get_tensor_model_parallel_group(),
          parallel_state.get_tensor_model_parallel_world_size())
    expert_tp = (parallel_state.get_expert_tensor_parallel_group(),
                 parallel_state.get_expert_tensor_parallel_world_size())
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    out: list[tuple[tuple[int, int], str, torch.Tensor]] = []
    for chunk in map(unwrap, chunks):
        for pattern, layer, expert, param in iter_global_params(chunk):
            if pattern == OUTPUT and cfg.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            tmap = table_entry(table, pattern, cfg, arch)
            group, size = expert_tp if tmap.expert else tp
            local = param.detach()
            shards = [local] if tmap.split == REPLICATED else _gather(local, group, size)
            tensors = merge_tp_shards(tmap, [s.cpu() for s in shards], cfg)
            # HF order: embeddings, layers by global index, then final norm and output layer.
            position = -1 if pattern.startswith("embedding") else (
                layer if layer is not None else cfg.num_layers)
            for name, tensor in zip(tmap.hf, tensors):
                tensor = tensor.to(dtype).contiguous()
                if not tmap.expert:
                    named = [(expand(name, layer), tensor)]
                else:  # the same local expert of every EP rank: global experts k * E/EP + j
                    local_experts = len(chunk.decoder.layers[0].mlp.local_expert_indices)
                    j = expert % local_experts
                    named = [(expand(name, layer, k * local_experts + j), t)
                             for k, t in enumerate(_gather(tensor, ep_group, ep_size))]
                if keep:
                    out += [((position, len(out) + n), hf_name, t)
                            for n, (hf_name, t) in enumerate(named)]
    out.sort(key=lambda item: item[0])
    return [(name, tensor) for _, name, tensor in out]


class _StageReceiver:
    """Global rank 0's view of every stage's tensors: its own stage, then each other stage as
    the stage's sender delivers it. :meth:`drain` receives whatever is still pending after a
    failure, so no sender stays blocked."""

    def __init__(self):
        self.pending = dist.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group())[1:]
        self.own: list[tuple[str, torch.Tensor]] = []

    def collect_own(self, chunks, cfg: ModelConfig, dtype: torch.dtype) -> None:
        """Stage 0's tensors, gathered before writing starts: its TP all-gathers must complete
        even if writing then fails."""
        self.own = stage_hf_tensors(chunks, cfg, dtype)

    def _receive(self, src: int):
        box = [None]
        dist.recv_object_list(box, src=src)
        return box[0]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.own
        self.own = []
        while self.pending:
            src = self.pending.pop(0)
            status, payload = self._receive(src)
            if status != "ok":
                raise RuntimeError(f"rank {src}: {payload}")
            yield from payload

    def drain(self) -> None:
        while self.pending:
            self._receive(self.pending.pop(0))


def export_hf(chunks: list[torch.nn.Module], model_cfg: ModelConfig, out_dir: str,
              dtype: str = "bfloat16", tokenizer_dir: str | None = None,
              max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write the model as an HF folder at ``out_dir``: config.json (the source folder's, with
    ``dtype``), ``model-0000x-of-0000y.safetensors`` + index (vocab padding removed), the source
    generation_config.json and the tokenizer files of ``tokenizer_dir`` (default: the model's
    ``hf_path``). Replaces an existing ``out_dir`` only once the new folder is complete.

    Collective: every rank of the job calls it with its chunks (DDP-wrapped or not).

    Raises:
        ValueError: unknown dtype (before any communication), or whatever rank 0 hit while
            writing (re-raised on every rank as RuntimeError).
    """
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    is_rank0 = dist.get_rank() == 0
    sender = (parallel_state.get_tensor_model_parallel_rank() == 0
              and parallel_state.get_data_parallel_rank() == 0)
    error = None
    if is_rank0:
        receiver = _StageReceiver()
        try:
            receiver.collect_own(chunks, model_cfg, torch_dtype)
            _write_folder(receiver.tensors(), model_cfg, out_dir, dtype,
                          tokenizer_dir or model_cfg.hf_path, max_shard_bytes)
        except Exception as exc:  # reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
        finally:
            receiver.drain()
    else:
        try:
            payload = ("ok", stage_hf_tensors(chunks, model_cfg, torch_dtype, keep=sender))
        except Exception as exc:  # a sender must always answer rank 0
            payload = ("error", f"{type(exc).__name__}: {exc}")
        if sender:
            dist.send_object_list([payload], dst=0)
        elif payload[0] != "ok":
            error = payload[1]
    box = [error if is_rank0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(f"export to {out_dir} failed on rank 0: {box[0]}")
    if error is not None:
        raise RuntimeError(f"export to {out_dir} failed on rank {dist.get_rank()}: {error}")


def _write_folder(tensors: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig, out_dir: str,
                  dtype: str, tokenizer_dir: str, max_shard_bytes: int) -> None:
    """Rank 0's part of :func:`export_hf`: everything into ``<out_dir>.tmp-<pid>``, then rename."""
    out_dir = os.path.abspath(out_dir)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        config = hf_config_dict(cfg, dtype)
        write_safetensors_shards(tensors, tmp, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if cfg.hf_path and os.path.isfile(os.path.join(cfg.hf_path, "generation_config.json")):
            shutil.copy2(os.path.join(cfg.hf_path, "generation_config.json"), tmp)
        if tokenizer_dir:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(tokenizer_dir, name)):
                    shutil.copy2(os.path.join(tokenizer_dir, name), tmp)
        old = f"{out_dir}.old-{os.getpid()}"
        if os.path.exists(out_dir):
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
