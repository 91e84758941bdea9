"""Model-only megatron-core distributed checkpoints, loadable at any TP x PP (x VPP) layout.

The checkpoint is megatron-core's ``dist_checkpointing`` format of ``model.sharded_state_dict()``:
every tensor is stored once under its global key (``decoder.layers.<global index>...``) with its
slice offsets, so a job with another layout reads back exactly the slices it owns.

Writes are atomic: all ranks write into ``<ckpt_dir>.tmp``, the manifest of checksums is written
last, and rank 0 renames the folder to ``ckpt_dir`` (an existing ``ckpt_dir`` is replaced only
then; :mod:`~dpo_megatron.checkpointing.storage`). A crash mid-save leaves the previous checkpoint
intact; loading verifies every file (:mod:`~dpo_megatron.checkpointing.integrity`).

Saves are synchronous and use an in-process results queue (``dpo_megatron.compat.dist_ckpt_queue``:
megatron-core 0.16 would otherwise spawn a ``multiprocessing`` Manager that re-imports the entry
module), and the writer processes it forks die with their rank
(``dpo_megatron.compat.dist_ckpt_writer_orphans``): :func:`save_sharded`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from dpo_megatron.checkpointing.integrity import load_sharded, verify_or_raise
from dpo_megatron.checkpointing.storage import CheckpointWriter
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.utils import ranks
from dpo_megatron.utils.modules import unwrap

MODEL_CONFIG_FILE = "model_config.json"
"""ModelConfig of the saved model (written when given), so converters can rebuild it."""


def _sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` for virtual pipeline
    chunks (Megatron-LM's convention); the tensors' keys inside are global either way."""
    models = [unwrap(c) for c in chunks]
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def load_chunks(chunks: list[torch.nn.Module], loaded: dict) -> None:
    """Load the model state of a checkpoint read with :func:`_sharded_state_dict`'s keys
    (``model``, or ``model0``, ``model1``, ... for virtual pipeline chunks) into the chunks,
    strictly (every parameter present, no extra key)."""
    models = [unwrap(c) for c in chunks]
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for model, key in zip(models, keys):
        model.load_state_dict(loaded[key], strict=True)


def sharded_bytes(sharded_state_dict: dict) -> int:
    """Bytes of the tensors this rank writes for ``sharded_state_dict`` (main replicas only):
    the checkpoint writer's free-space estimate."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    total = 0
    for value in nested_values(sharded_state_dict):
        if (
            isinstance(value, ShardedTensor)
            and value.data is not None
            and is_main_replica(value.replica_id)
        ):
            total += value.data.numel() * value.data.element_size()
    return total


def write_model_config(folder: str, model_cfg: ModelConfig) -> None:
    """``model_config.json`` into a checkpoint folder (rank 0 only; other ranks do nothing)."""
    if not ranks.is_rank0():
        return
    with open(os.path.join(folder, MODEL_CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(model_cfg), f, indent=2)


def save_sharded(state: dict, folder: str) -> None:
    """``dist_checkpointing.save`` of a sharded state dict into ``folder``, synchronously, with
    the two megatron-core 0.16 workarounds every save of this engine needs: an in-process
    results queue (:mod:`~dpo_megatron.compat.dist_ckpt_queue`) and writer processes that die
    with their rank (:mod:`~dpo_megatron.compat.dist_ckpt_writer_orphans`)."""
    from megatron.core import dist_checkpointing

    from dpo_megatron.compat import dist_ckpt_queue, dist_ckpt_writer_orphans

    dist_ckpt_queue.use_in_process_results_queue()
    dist_ckpt_writer_orphans.writers_die_with_their_rank()
    dist_checkpointing.save(state, folder)


def save_model_checkpoint(
    chunks: list[torch.nn.Module], ckpt_dir: str, model_cfg: ModelConfig | None = None
) -> None:
    """Save this job's model weights as a distributed checkpoint at ``ckpt_dir`` (collective),
    atomically and with a manifest of checksums (:class:`~dpo_megatron.checkpointing.storage.
    CheckpointWriter`).

    ``model_cfg``, when given, is stored as ``model_config.json`` next to the tensors.

    Raises:
        CheckpointSaveError: the disk is full or read-only, or a write failed (the message
            names the path; nothing is left behind).
    """
    state = _sharded_state_dict(chunks)
    writer = CheckpointWriter(ckpt_dir, sharded_bytes(state))
    writer.phase(lambda tmp: save_sharded(state, tmp))
    if model_cfg is not None:
        writer.phase(lambda tmp: write_model_config(tmp, model_cfg))
    writer.commit()


def load_model_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str) -> None:
    """Load weights saved by :func:`save_model_checkpoint` (any layout) into this rank's chunks
    (collective). Every parameter of the chunks must be in the checkpoint. Every file is first
    checked against the checkpoint's manifest and no file may hold pickled code
    (:mod:`~dpo_megatron.checkpointing.integrity`).

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a distributed checkpoint.
        CheckpointIntegrityError: a file is missing, changed or unsafe (named in the message).
    """
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(
            f"{ckpt_dir}: not a megatron-core distributed checkpoint (no metadata.json)"
        )
    verify_or_raise(ckpt_dir)
    sharded = _sharded_state_dict(chunks)
    load_chunks(chunks, load_sharded(sharded, ckpt_dir))


def load_model_config(ckpt_dir: str) -> ModelConfig | None:
    """The ModelConfig stored with a checkpoint, or None when it was saved without one."""
    path = os.path.join(ckpt_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        fields = json.load(f)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})
