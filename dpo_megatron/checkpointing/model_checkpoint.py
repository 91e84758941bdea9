"""Model-only megatron-core distributed checkpoints, loadable at any TP x PP (x VPP) layout.

The checkpoint is megatron-core's ``dist_checkpointing`` format of ``model.sharded_state_dict()``:
every tensor is stored once under its global key (``decoder.layers.<global index>...``) with its
slice offsets, so a job with another layout reads back exactly the slices it owns.

Writes are atomic: all ranks write into ``<ckpt_dir>.tmp``, and after a barrier rank 0 renames
it to ``ckpt_dir`` (an existing ``ckpt_dir`` is replaced only then). A crash mid-save leaves the
previous checkpoint intact.

Saves are synchronous and use an in-process results queue (``dpo_megatron.compat.dist_ckpt_queue``:
megatron-core 0.16 would otherwise spawn a ``multiprocessing`` Manager that re-imports the entry
module).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from dpo_megatron.models.config import ModelConfig

MODEL_CONFIG_FILE = "model_config.json"
"""ModelConfig of the saved model (written when given), so converters can rebuild it."""


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return module


def _sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` for virtual pipeline
    chunks (Megatron-LM's convention); the tensors' keys inside are global either way."""
    models = [_unwrap(c) for c in chunks]
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def replace_dir(tmp: str, final: str) -> None:
    """Rename the complete folder ``tmp`` to ``final``; an existing ``final`` is moved aside
    first and deleted only after the rename (one process, e.g. rank 0, calls this)."""
    old = f"{final}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_model_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str,
                          model_cfg: Optional[ModelConfig] = None) -> None:
    """Save this job's model weights as a distributed checkpoint at ``ckpt_dir`` (collective).

    ``model_cfg``, when given, is stored as ``model_config.json`` next to the tensors.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = os.path.abspath(ckpt_dir)
    tmp = f"{ckpt_dir}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    from dpo_megatron.compat import dist_ckpt_queue

    dist_ckpt_queue.use_in_process_results_queue()
    dist_checkpointing.save(_sharded_state_dict(chunks), tmp)
    _barrier()
    if rank == 0:
        if model_cfg is not None:
            with open(os.path.join(tmp, MODEL_CONFIG_FILE), "w") as f:
                json.dump(dataclasses.asdict(model_cfg), f, indent=2)
        replace_dir(tmp, ckpt_dir)
    _barrier()


def load_model_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str) -> None:
    """Load weights saved by :func:`save_model_checkpoint` (any layout) into this rank's chunks
    (collective). Every parameter of the chunks must be in the checkpoint.

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a distributed checkpoint.
    """
    from megatron.core import dist_checkpointing

    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"{ckpt_dir}: not a megatron-core distributed checkpoint "
                                "(no metadata.json)")
    sharded = _sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(sharded, ckpt_dir)
    models = [_unwrap(c) for c in chunks]
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for model, key in zip(models, keys):
        model.load_state_dict(loaded[key], strict=True)


def load_model_config(ckpt_dir: str) -> Optional[ModelConfig]:
    """The ModelConfig stored with a checkpoint, or None when it was saved without one."""
    path = os.path.join(ckpt_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        fields = json.load(f)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})
