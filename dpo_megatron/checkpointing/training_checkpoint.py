"""Training checkpoints: everything a run needs to continue exactly where it stopped.

One checkpoint is a folder ``<save>/iter_<step, 7 digits>/`` holding

* a megatron-core distributed checkpoint of ``{"model": ..., "optimizer": ...}``
  (``metadata.json``, ``*.distcp``, ``common.pt``). The model part has the same keys as
  :func:`~dpo_megatron.checkpointing.save_model_checkpoint`'s, so ``model.load=<this folder>``
  starts a new run (e.g. DPO after SFT) from its weights. The optimizer part is megatron-core's
  ``optimizer.sharded_state_dict(model_sharded_state_dict)``; for the distributed optimizer it
  uses the ``fully_reshardable`` format, where each parameter's Adam moments are stored under
  the parameter's global key, so they reshard to another TP / PP / DP layout like weights;
* ``train_state.json`` (rank 0): step, LR scheduler, data sampler position, loss state (BCO),
  skipped-step counter and the layout it was saved at;
* ``rng/rank_<global rank>.pt`` (every rank): Python, NumPy, torch and megatron-core's
  model-parallel RNG tracker states, restored when the layout is the same;
* ``model_config.json``: the architecture (``load_model_config``).

Writes are atomic like model checkpoints: everything goes into ``iter_N.tmp`` and rank 0 renames
it to ``iter_N`` after every rank has finished, so a run killed while saving leaves
``iter_N.tmp`` behind (ignored, removed by the next save) and the previous checkpoint intact.
A folder counts as a checkpoint only if its name is ``iter_<digits>`` and it holds both
``metadata.json`` and ``train_state.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
import shutil
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from dpo_megatron.compat import dist_ckpt_queue, torch_adam_resume
from dpo_megatron.checkpointing.model_checkpoint import (
    MODEL_CONFIG_FILE,
    _barrier,
    _sharded_state_dict,
    _unwrap,
    replace_dir,
)

TRAIN_STATE_FILE = "train_state.json"
"""Non-tensor state of the run (rank 0)."""
RNG_DIR = "rng"
"""Per-rank RNG states."""
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "chained_optim_avoid_prefix": True}
"""megatron-core's layout-independent distributed-optimizer format: state is gathered over the
data-parallel group and stored per parameter under its global key, so it reshards across TP, PP
and DP (0.16 rejects the older fully_sharded_model_space; dp_reshardable reshards DP only).
``chained_optim_avoid_prefix``: a mixture-of-experts model at expert parallel > 1 has two
optimizers (dense and expert parameters reduce over different data-parallel groups) and one at
EP 1 has one; without their ``chained_<i>.`` key prefixes the state is keyed by parameter alone,
so it reshards between EP sizes too (a one-optimizer model's keys are unchanged)."""
_ITER_RE = re.compile(r"^iter_(\d{7})$")


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps: ``iter_0000010``."""
    return f"iter_{step:07d}"


def is_complete_checkpoint(path: str) -> bool:
    """True for a finished training checkpoint folder (both metadata files present)."""
    return (_ITER_RE.match(os.path.basename(os.path.normpath(path))) is not None
            and os.path.isfile(os.path.join(path, "metadata.json"))
            and os.path.isfile(os.path.join(path, TRAIN_STATE_FILE)))


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``save_dir`` as (step, path), oldest first; unfinished
    ``.tmp`` folders and anything else are ignored."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        m = _ITER_RE.match(name)
        path = os.path.join(save_dir, name)
        if m and is_complete_checkpoint(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest_checkpoint(save_dir: str) -> Optional[str]:
    """The newest complete checkpoint under ``save_dir``, or None."""
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, save_dir: str) -> Optional[str]:
    """The checkpoint a run continues from, per ``checkpoint.resume``.

    ``""`` / ``"none"``: None (fresh start). ``"auto"``: the latest complete checkpoint in
    ``save_dir`` (None if there is none). Anything else: a checkpoint folder, or a folder of
    checkpoints whose latest is taken.

    Raises:
        FileNotFoundError: an explicit path holds no complete checkpoint.
    """
    if resume in ("", "none"):
        return None
    if resume == "auto":
        return find_latest_checkpoint(save_dir)
    if is_complete_checkpoint(resume):
        return resume
    latest = find_latest_checkpoint(resume)
    if latest is None:
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r}: no complete training checkpoint there (expected an "
            f"iter_NNNNNNN folder with metadata.json and {TRAIN_STATE_FILE}, or a folder of them)")
    return latest


def prune_checkpoints(save_dir: str, keep_last_n: int) -> list[str]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints (0: keep all), and stale
    ``.tmp`` folders. Call on one rank after a save completed. Returns the deleted paths."""
    removed = []
    if keep_last_n > 0:
        for _, path in list_checkpoints(save_dir)[:-keep_last_n]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def current_layout(use_distributed_optimizer: bool) -> dict[str, Any]:
    """The parallel layout a checkpoint is saved or loaded at (stored in train_state.json)."""
    from megatron.core import parallel_state as ps

    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size":
            ps.get_virtual_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "use_distributed_optimizer": use_distributed_optimizer,
    }


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: Python, NumPy, torch CPU (and CUDA), megatron-core's tracker."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _full_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    """``{"model"...: model sharded state, "optimizer": optimizer sharded state}``."""
    state = _sharded_state_dict(chunks)
    if optimizer is not None:
        if is_loading:
            torch_adam_resume.materialize_optimizer_state(optimizer)
        model_state = {}
        for value in state.values():
            model_state.update(value)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return state


def save_training_checkpoint(ckpt_dir: str, chunks: list, optimizer, train_state: dict,
                             model_cfg=None) -> None:
    """Write a training checkpoint at ``ckpt_dir`` atomically (collective: every rank calls it).

    Args:
        ckpt_dir: the checkpoint folder, normally ``<save>/`` + :func:`checkpoint_name` (step).
        chunks: this rank's policy chunks (DDP-wrapped or not).
        optimizer: megatron-core optimizer (its state is saved sharded), or None.
        train_state: JSON-serialisable run state (step, scheduler, sampler, loss, layout, ...),
            written by rank 0 as ``train_state.json``.
        model_cfg: ModelConfig stored as ``model_config.json`` when given.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = os.path.abspath(ckpt_dir)
    tmp = f"{ckpt_dir}.tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_ckpt_queue.use_in_process_results_queue()
    dist_checkpointing.save(_full_state_dict(chunks, optimizer, is_loading=False), tmp)
    if rank == 0:
        os.makedirs(os.path.join(tmp, RNG_DIR))
    _barrier()
    torch.save(rng_state(), os.path.join(tmp, RNG_DIR, f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        if model_cfg is not None:
            with open(os.path.join(tmp, MODEL_CONFIG_FILE), "w") as f:
                json.dump(dataclasses.asdict(model_cfg), f, indent=2)
        # train_state.json last: it marks the folder complete (see is_complete_checkpoint).
        with open(os.path.join(tmp, TRAIN_STATE_FILE), "w") as f:
            json.dump(train_state, f, indent=2)
        replace_dir(tmp, ckpt_dir)
    _barrier()


def _optimizer_common(tree) -> dict:
    """The non-tensor part (parameter groups, sharding type) of each optimizer of a requested
    distributed-optimizer state, by index: ``{0: ..., 1: ...}`` for a chained optimizer,
    ``{None: ...}`` for one (a dict with ``param_state``)."""
    if not tree:
        return {}
    singles = {None: tree} if "param_state" in tree else tree
    return {k: {key: value for key, value in single.items() if key != "param_state"}
            for k, single in singles.items()}


def _adam_step(tree) -> Optional[float]:
    """The Adam step stored in any parameter group under ``tree`` (all groups step together)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for group in node.get("param_groups") or []:
            if isinstance(group, dict) and "step" in group:
                return group["step"]
        stack.extend(node.values())
    return None


def _match_optimizer_structure(requested: dict, loaded):
    """The loaded optimizer state in the structure this run's optimizer expects.

    A mixture-of-experts model has one distributed optimizer at expert parallel 1 and two (dense
    and expert parameters) above it. Their tensor state is keyed by parameter and loads across
    the change (``OPTIMIZER_METADATA``), but the non-tensor part (parameter groups, flagged by
    ``is_expert_parallel``) comes back in the saved structure, beside the requested one. Then each
    optimizer keeps its own parameter groups, with the checkpoint's Adam step, and takes its
    loaded tensor state. An unchanged structure is returned as loaded.

    Args:
        requested: :func:`_optimizer_common` of the state that was asked for (before loading).
        loaded: ``dist_checkpointing.load(...)["optimizer"]``.
    """
    indexed = {k for k in loaded if isinstance(k, int)}
    if None in requested:  # one optimizer now: saved parts of a chained one are under 0, 1, ...
        saved = [loaded[k] for k in indexed]
    else:  # chained now: a single saved optimizer's parts are beside the indices
        saved = [v for k, v in loaded.items() if not isinstance(k, int)]
    if not saved:
        return loaded
    step = next((s for s in map(_adam_step, saved) if s is not None), None)
    rebuilt = {}
    for key, common in requested.items():
        part = copy.deepcopy(common)
        for group in part.get("optimizer", {}).get("param_groups", []):
            if step is not None and "step" in group:
                group["step"] = step
        source = loaded if key is None else loaded[key]
        rebuilt[key] = {**part, "param_state": source["param_state"]}
    return rebuilt[None] if None in rebuilt else rebuilt


def read_train_state(ckpt_dir: str) -> dict:
    """``train_state.json`` of a checkpoint."""
    with open(os.path.join(ckpt_dir, TRAIN_STATE_FILE)) as f:
        return json.load(f)


def load_training_checkpoint(ckpt_dir: str, chunks: list, optimizer,
                             use_distributed_optimizer: bool) -> dict:
    """Load model, optimizer and this rank's RNG state from ``ckpt_dir`` (collective).

    Weights load at any layout. The optimizer state loads at any layout when both runs use the
    distributed optimizer or both do not (megatron-core reshards either format); the RNG states
    are restored only when the layout is unchanged (they are per rank).

    Returns:
        The checkpoint's train state (``train_state.json``); the caller restores scheduler,
        sampler and loss state from it.

    Raises:
        ValueError: the checkpoint's optimizer format (distributed or not) differs from this
            run's; load the weights alone with ``model.load=<ckpt_dir>`` instead.
    """
    from megatron.core import dist_checkpointing

    train_state = read_train_state(ckpt_dir)
    saved = train_state["layout"]
    if optimizer is not None and saved["use_distributed_optimizer"] != use_distributed_optimizer:
        raise ValueError(
            f"{ckpt_dir} was saved with train.use_distributed_optimizer="
            f"{saved['use_distributed_optimizer']} but this run has {use_distributed_optimizer}: "
            "optimizer state is not converted between the two formats. Use the same setting, "
            "or start a new run from the weights only with model.load=" + ckpt_dir)
    state = _full_state_dict(chunks, optimizer, is_loading=True)
    requested_optimizer = copy.deepcopy(
        {k: v for k, v in _optimizer_common(state.get("optimizer")).items()})
    loaded = dist_checkpointing.load(state, ckpt_dir)
    models = [_unwrap(c) for c in chunks]
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for model, key in zip(models, keys):
        model.load_state_dict(loaded[key], strict=True)
    if optimizer is not None:
        optimizer_state = _match_optimizer_structure(requested_optimizer, loaded["optimizer"])
        with torch_adam_resume.keep_torch_adam_step(optimizer):
            optimizer.load_state_dict(optimizer_state)
    if saved == current_layout(use_distributed_optimizer):
        rng_file = os.path.join(ckpt_dir, RNG_DIR, f"rank_{_rank():05d}.pt")
        set_rng_state(torch.load(rng_file, weights_only=False))
    return train_state
