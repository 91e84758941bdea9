"""Training checkpoints: everything a run needs to continue exactly where it stopped.

One checkpoint is a folder ``<save>/iter_<step, 7 digits>/`` holding

* a megatron-core distributed checkpoint of ``{"model": ..., "optimizer": ...}``
  (``metadata.json``, ``.metadata``, ``*.distcp``, ``common.pt``). The model part has the same
  keys as :func:`~dpo_megatron.checkpointing.save_model_checkpoint`'s, so ``model.load=<this
  folder>`` starts a new run (e.g. DPO after SFT) from its weights. The optimizer part is
  megatron-core's ``optimizer.sharded_state_dict(model_sharded_state_dict)``; for the
  distributed optimizer it uses the ``fully_reshardable`` format, where each parameter's Adam
  moments are stored under the parameter's global key, so they reshard to another TP / PP / DP
  layout like weights;
* ``train_state.json`` (rank 0): step, the run's id, LR scheduler, data sampler position, loss
  state (BCO), skipped-step counter and the layout it was saved at;
* ``rng/rank_<global rank>.pt`` (every rank): Python, NumPy, torch and megatron-core's
  model-parallel RNG tracker states as tensors and plain containers (read back with
  ``torch.load(weights_only=True)``), restored when the layout is the same;
* ``model_config.json``: the architecture (``load_model_config``);
* ``manifest.json``, written last: size and XXH3-128 digest of every other file
  (:mod:`~dpo_megatron.checkpointing.integrity`); loading checks them all first.

Writes are atomic (:class:`~dpo_megatron.checkpointing.storage.CheckpointWriter`): everything
goes into ``iter_N.tmp`` and rank 0 renames it to ``iter_N`` after every rank has finished, so a
run killed while saving leaves ``iter_N.tmp`` behind (ignored, removed when the run resumes) and
the previous checkpoint intact; a save that fails (full or read-only disk) removes its ``.tmp``
and says why. A folder counts as a checkpoint only if its name is ``iter_<digits>`` and it holds
both ``metadata.json`` and ``train_state.json``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dpo_megatron.checkpointing.integrity import (
    CheckpointIntegrityError,
    load_sharded,
    load_weights_only,
    verify_or_raise,
)
from dpo_megatron.checkpointing.model_checkpoint import (
    _sharded_state_dict,
    load_chunks,
    save_sharded,
    sharded_bytes,
    write_model_config,
)
from dpo_megatron.checkpointing.storage import CheckpointWriter
from dpo_megatron.compat import torch_adam_resume
from dpo_megatron.utils import ranks
from dpo_megatron.utils.files import write_json_atomic

TRAIN_STATE_FILE = "train_state.json"
"""Non-tensor state of the run (rank 0)."""
RNG_DIR = "rng"
"""Per-rank RNG states."""
OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}
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
    return (
        _ITER_RE.match(os.path.basename(os.path.normpath(path))) is not None
        and os.path.isfile(os.path.join(path, "metadata.json"))
        and os.path.isfile(os.path.join(path, TRAIN_STATE_FILE))
    )


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


def find_latest_checkpoint(save_dir: str) -> str | None:
    """The newest complete checkpoint under ``save_dir``, or None."""
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str, save_dir: str) -> str | None:
    """The checkpoint a run continues from, per ``checkpoint.resume`` (before verification:
    :func:`resume_candidates` lists the fall-backs of ``auto``).

    ``""`` / ``"none"``: None (fresh start). ``"auto"``: the latest complete checkpoint in
    ``save_dir`` (None if there is none). Anything else: a checkpoint folder, or a folder of
    checkpoints whose latest is taken.

    Raises:
        FileNotFoundError: an explicit path holds no complete checkpoint.
    """
    candidates = resume_candidates(resume, save_dir)
    return candidates[0] if candidates else None


def resume_candidates(resume: str, save_dir: str) -> list[str]:
    """Checkpoints ``checkpoint.resume`` may continue from, the preferred first: for ``auto``
    every complete checkpoint of ``save_dir``, newest first (the first that verifies is taken);
    for an explicit path the one it names; for ``none`` nothing.

    Raises:
        FileNotFoundError: an explicit path holds no complete checkpoint.
    """
    if resume in ("", "none"):
        return []
    if resume == "auto":
        return [path for _, path in reversed(list_checkpoints(save_dir))]
    if is_complete_checkpoint(resume):
        return [resume]
    latest = find_latest_checkpoint(resume)
    if latest is None:
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r}: no complete training checkpoint there (expected an "
            f"iter_NNNNNNN folder with metadata.json and {TRAIN_STATE_FILE}, or a folder of them)"
        )
    return [latest]


def checkpoint_run_id(ckpt_dir: str) -> str | None:
    """The id of the run that wrote a checkpoint (``train_state.json``), None if unreadable or
    saved before runs had ids."""
    try:
        return read_train_state(ckpt_dir).get("run_id")
    except (OSError, ValueError):
        return None


def prune_checkpoints(save_dir: str, keep_last_n: int, run_id: str | None = None) -> list[str]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints *of run ``run_id``* (0:
    keep all); checkpoints of any other run, and unreadable ones, are never touched. Call on one
    rank after a save completed. Returns the deleted paths."""
    removed = []
    if keep_last_n > 0:
        own = [path for _, path in list_checkpoints(save_dir) if checkpoint_run_id(path) == run_id]
        for path in own[:-keep_last_n]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_stale_tmp(save_dir: str) -> list[str]:
    """Delete the ``iter_N.tmp`` / ``iter_N.old`` folders that saves killed mid-way left behind
    (call on one rank while holding the run-folder lock: no save of another run can be under
    way). Returns the deleted paths."""
    removed = []
    if os.path.isdir(save_dir):
        for name in sorted(os.listdir(save_dir)):
            if re.match(r"^iter_\d{7}\.(tmp|old)$", name):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
                removed.append(os.path.join(save_dir, name))
    return removed


def current_layout(use_distributed_optimizer: bool) -> dict[str, Any]:
    """The parallel layout a checkpoint is saved or loaded at (stored in train_state.json)."""
    from megatron.core import parallel_state as ps

    layout = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "use_distributed_optimizer": use_distributed_optimizer,
    }
    # CP ranks hold the same parameter shards; the distributed optimizer shards its state over
    # DP x CP, so a CP change reshards the optimizer like a DP change. Recorded only when CP > 1,
    # so checkpoints written before CP existed still compare equal at CP 1 (exact RNG resume).
    if ps.get_context_parallel_world_size() > 1:
        layout["context_parallel_size"] = ps.get_context_parallel_world_size()
    return layout


def saved_layout(train_state: dict) -> dict[str, Any]:
    """The layout a checkpoint was saved at (``train_state.json``'s ``layout``), with the sizes
    that versions before expert parallelism did not record filled in as those versions ran
    (EP 1, expert TP = TP, megatron-core's default), so that it compares equal to
    :func:`current_layout` at the same layout. (Without them a dense run resumed at its own
    layout read as resharded, ``None -> 1``: its RNG states were not restored and a run from
    random weights was warned of a re-drawn reference.)"""
    layout = dict(train_state["layout"])
    layout.setdefault("expert_model_parallel_size", 1)
    layout.setdefault("expert_tensor_parallel_size", layout.get("tensor_model_parallel_size"))
    return layout


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as tensors and plain containers (loadable with
    ``torch.load(weights_only=True)``): Python's (a tuple of ints), NumPy's legacy global
    generator (its 624-word key as an int64 tensor), torch CPU (and CUDA), megatron-core's
    tracker."""
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_numpy_state(state) -> None:
    """Restore NumPy's legacy global generator from :func:`rng_state`'s ``numpy`` entry (or
    from ``np.random.get_state()``'s tuple, as checkpoints before tensors held it)."""
    if isinstance(state, dict):
        state = (
            state["bit_generator"],
            state["keys"].numpy().astype(np.uint32),
            state["pos"],
            state["has_gauss"],
            state["cached_gaussian"],
        )
    np.random.set_state(tuple(state))


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output."""
    from megatron.core import tensor_parallel

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _full_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    """``{"model": ..., "optimizer": ...}`` for one chunk, ``{"model0": ..., "model1": ...,
    "optimizer": ...}`` for virtual pipeline chunks.

    The optimizer is given the model part as it is, nested per chunk (as Megatron-LM's
    ``generate_state_dict`` does): megatron-core finds each parameter's ShardedTensor by walking
    every value of that tree. The chunks' dicts must not be merged into one: their local keys
    (``decoder.layers.0...``: layer numbers within a chunk) are the same in every chunk, so a
    merge keeps only the last chunk's entries and the optimizer fails on the first parameter of
    another chunk (``Model param ... not in model_sharded_state_dict``)."""
    state = _sharded_state_dict(chunks)
    if optimizer is not None:
        if is_loading:
            torch_adam_resume.materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    return state


def _rng_file(folder: str, rank: int) -> str:
    return os.path.join(folder, RNG_DIR, f"rank_{rank:05d}.pt")


def _save_rng(folder: str) -> None:
    os.makedirs(os.path.join(folder, RNG_DIR), exist_ok=True)
    torch.save(rng_state(), _rng_file(folder, ranks.rank()))


def save_training_checkpoint(
    ckpt_dir: str, chunks: list, optimizer, train_state: dict, model_cfg=None
) -> str:
    """Write a training checkpoint at ``ckpt_dir`` atomically, with its manifest (collective:
    every rank calls it).

    Args:
        ckpt_dir: the checkpoint folder, normally ``<save>/`` + :func:`checkpoint_name` (step).
        chunks: this rank's policy chunks (DDP-wrapped or not).
        optimizer: megatron-core optimizer (its state is saved sharded), or None. It must hold
            state (at least one update applied): megatron-core cannot save a fresh optimizer.
        train_state: JSON-serialisable run state (step, run id, scheduler, sampler, loss,
            layout, ...), written by rank 0 as ``train_state.json``.
        model_cfg: ModelConfig stored as ``model_config.json`` when given.

    Returns:
        The save's one-line report (:meth:`CheckpointWriter.report`: files, size, seconds, and
        the seconds of the checksums among them).

    Raises:
        CheckpointSaveError: on every rank, naming the path and the cause (no space left,
            read-only file system, ...); the ``.tmp`` folder is removed.
    """
    state = _full_state_dict(chunks, optimizer, is_loading=False)
    writer = CheckpointWriter(ckpt_dir, sharded_bytes(state))
    writer.phase(lambda tmp: save_sharded(state, tmp))
    writer.phase(_save_rng)

    def write_json(tmp: str) -> None:
        if model_cfg is not None:
            write_model_config(tmp, model_cfg)
        if ranks.is_rank0():
            write_json_atomic(os.path.join(tmp, TRAIN_STATE_FILE), train_state)

    writer.phase(write_json)
    writer.commit()
    return writer.report()


def _optimizer_common(tree) -> dict:
    """The non-tensor part (parameter groups, sharding type) of each optimizer of a requested
    distributed-optimizer state, by index: ``{0: ..., 1: ...}`` for a chained optimizer,
    ``{None: ...}`` for one (a dict with ``param_state``)."""
    if not isinstance(tree, dict) or not tree:
        return {}
    if "param_state" in tree:
        singles = {None: tree}
    else:  # a chained one: {0: {..., "param_state"}, 1: ...}; anything else is not restructured
        singles = {k: v for k, v in tree.items() if isinstance(v, dict) and "param_state" in v}
        if len(singles) != len(tree):
            return {}
    return {
        k: {key: value for key, value in single.items() if key != "param_state"}
        for k, single in singles.items()
    }


def _adam_step(tree) -> float | None:
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

    Returns ``loaded`` unchanged when ``requested`` is empty (not a distributed-optimizer
    state: ``train.use_distributed_optimizer=false``).
    """
    if not requested:  # not a distributed-optimizer state: nothing to restructure
        return loaded
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


def checkpoint_lora(ckpt_dir: str) -> dict | None:
    """The LoRA settings an adapter-only checkpoint was saved with (``train_state.json``'s
    ``lora``: rank, alpha, ... and ``base``), or None: whole weights, or a folder without
    ``train_state.json`` (a converted checkpoint).

    Raises:
        CheckpointIntegrityError: ``train_state.json`` is not valid JSON.
    """
    if not os.path.isfile(os.path.join(ckpt_dir, TRAIN_STATE_FILE)):
        return None
    return read_train_state(ckpt_dir).get("lora") or None


def read_train_state(ckpt_dir: str) -> dict:
    """``train_state.json`` of a checkpoint.

    Raises:
        CheckpointIntegrityError: the file is not valid JSON (naming it).
    """
    path = os.path.join(ckpt_dir, TRAIN_STATE_FILE)
    with open(path) as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise CheckpointIntegrityError(
                ckpt_dir, [f"{TRAIN_STATE_FILE}: not valid JSON ({e})"]
            ) from None


def load_training_checkpoint(
    ckpt_dir: str, chunks: list, optimizer, use_distributed_optimizer: bool, verified: bool = False
) -> dict:
    """Load model, optimizer and this rank's RNG state from ``ckpt_dir`` (collective).

    Every file is checked against the manifest and for pickled code first, unless the caller
    has just done so (``verified``). Weights load at any layout. The optimizer state loads at
    any layout when both runs use the distributed optimizer or both do not (megatron-core
    reshards either format); the RNG states are restored only when the layout is unchanged
    (they are per rank) and the checkpoint has them.

    Returns:
        The checkpoint's train state (``train_state.json``); the caller restores scheduler,
        sampler and loss state from it.

    Raises:
        CheckpointIntegrityError / UnsafeCheckpointError: a file is missing, changed, or holds
            pickled objects beyond tensors and plain containers (each named).
        ValueError: the checkpoint's optimizer format (distributed or not) differs from this
            run's; load the weights alone with ``model.load=<ckpt_dir>`` instead.
    """
    if not verified:
        verify_or_raise(ckpt_dir)
    train_state = read_train_state(ckpt_dir)
    saved = saved_layout(train_state)
    if optimizer is not None and saved["use_distributed_optimizer"] != use_distributed_optimizer:
        raise ValueError(
            f"{ckpt_dir} was saved with train.use_distributed_optimizer="
            f"{saved['use_distributed_optimizer']} but this run has {use_distributed_optimizer}: "
            "optimizer state is not converted between the two formats. Use the same setting, "
            "or start a new run from the weights only with model.load=" + ckpt_dir
        )
    state = _full_state_dict(chunks, optimizer, is_loading=True)
    requested_optimizer = copy.deepcopy(
        {k: v for k, v in _optimizer_common(state.get("optimizer")).items()}
    )
    loaded = load_sharded(state, ckpt_dir)
    load_chunks(chunks, loaded)
    if optimizer is not None:
        optimizer_state = _match_optimizer_structure(requested_optimizer, loaded["optimizer"])
        with torch_adam_resume.keep_torch_adam_step(optimizer):
            optimizer.load_state_dict(optimizer_state)
    if saved == current_layout(use_distributed_optimizer):
        rng_file = _rng_file(ckpt_dir, ranks.rank())
        if os.path.isfile(rng_file):
            set_rng_state(load_weights_only(rng_file, f"{RNG_DIR}/{os.path.basename(rng_file)}"))
        elif ranks.is_rank0():
            print(f"note: {ckpt_dir} has no {RNG_DIR}/ states: RNG states start fresh", flush=True)
    return train_state
