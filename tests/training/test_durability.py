"""Fault injection on whole runs (tiny model, at most 2 ranks): corrupted shards, planted payloads,
a fresh or a second run in a used run_dir, SIGTERM on one rank, a full disk, NaN steps, and
``kill -9`` of the launcher at random moments followed by a resume that must match a run that
was never interrupted, step for step and file for file.

Each case states the fault, then asserts the new behaviour: a clear error naming the file or
path, a fall-back with a warning, or an exact continuation.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.checkpointing.faults import flip_bytes, plant_in_dcp_item, tree_digest
from tests.checkpointing.test_storage import small_tmpfs
from tests.multirank import process_context, run_ranks
from tests.training.test_lifecycle import (
    TINY_MODEL,
    _train,
    read_metrics,
    run_train,
    tiny_config,
    write_fixture,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("tokens_per_s", "step_time_s")
"""Metrics that measure time: everything else must be bit-identical after a resume."""


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("durability_data"))


def exact_metrics(run_dir) -> dict:
    """metrics.jsonl of a run, by (split, step), without the timing fields."""
    out = {}
    for split in ("train", "eval"):
        for step, record in read_metrics(run_dir, split).items():
            out[(split, step)] = {k: v for k, v in record.items() if k not in TIMING}
    return out


def checkpoint_files(ckpt_dir) -> dict:
    """What must be bit-identical between two checkpoints of the same step: every file's bytes,
    except torch DCP's ``.metadata`` (it records the save's random id and the folder's path:
    compared unpickled, without those) and ``train_state.json`` (compared without the run id),
    and the manifest (it lists those two)."""
    out = {}
    for name, digest in tree_digest(str(ckpt_dir)).items():
        if name in (".metadata", "train_state.json", "manifest.json"):
            continue
        out[name] = digest
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # written by the test's own runs
    out[".metadata"] = (repr(metadata.state_dict_metadata), repr(metadata.storage_data))
    state = json.loads(Path(ckpt_dir, "train_state.json").read_text())
    state.pop("run_id")
    out["train_state.json"] = state
    return out


def _failure(fn, **kwargs) -> str:
    """The error text of a run expected to fail."""
    with pytest.raises(RuntimeError) as info:
        run_ranks(fn, **kwargs)
    return str(info.value)


# ----------------------------------------------------------------------------------------------
# full disk


def _train_filling_the_disk(run_dir, data_file, tok_dir, overrides, estimate):
    """train() where, right after the first checkpoint, the disk fills up to half a checkpoint
    of free space. Without ``estimate`` the checkpoint writer gets no free-space estimate, so
    the writes themselves run into the full disk (the pre-flight check normally catches it)."""
    import torch.distributed as dist

    from dpo_megatron.checkpointing import storage, training_checkpoint
    from dpo_megatron.training.run_checkpoint import Checkpointer

    if not estimate:
        training_checkpoint.sharded_bytes = lambda state: 0
    real_save = Checkpointer.save

    def save(self, counters):
        path = real_save(self, counters)
        if counters.step == 1 and dist.get_rank() == 0:
            size = sum(s for s, _ in tree_digest(path).values())
            filler = os.path.join(os.path.dirname(run_dir), "filler")
            with open(filler, "wb") as f:
                f.write(b"\0" * max(storage.free_bytes(filler) - size // 2, 0))
        dist.barrier()
        return path

    Checkpointer.save = save
    return _train(run_dir, data_file, tok_dir, overrides)


@pytest.mark.parametrize("estimate", [True, False], ids=["preflight", "mid_write"])
def test_full_disk_is_named_removes_its_tmp_and_the_previous_checkpoint_loads(
        tmp_path, fixture_files, estimate):
    """2 ranks on a 16 MB tmpfs that is full but for half a checkpoint when step 2 saves."""
    data_file, tok_dir = fixture_files
    common = ["train.train_iters=2", "checkpoint.save_interval=1", "checkpoint.keep_last_n=0",
              "parallel.tensor_model_parallel_size=2"]
    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        run_dir = disk / "run"
        error = _failure(_train_filling_the_disk, world_size=2, run_dir=str(run_dir),
                         data_file=data_file, tok_dir=tok_dir, overrides=common,
                         estimate=estimate)
        ckpts = run_dir / "checkpoints"
        assert f"CheckpointSaveError: saving checkpoint {ckpts / 'iter_0000002'} failed" in error
        assert "no space left on device" in error
        assert (("it needs about" in error) if estimate
                else "no space left on device writing " in error), error[-2000:]
        assert "Removed iter_0000002.tmp" in error
        assert sorted(os.listdir(ckpts)) == ["iter_0000001"]  # the .tmp is gone
        os.remove(disk / "filler")
        # The previous checkpoint verifies and loads (resume=auto, nothing left to train).
        run_train(run_dir, data_file, tok_dir, "train.train_iters=1", "checkpoint.resume=auto",
                  *common[1:], world_size=2, tp=2)
        log = (run_dir / "train.log").read_text()
        assert f"verified {ckpts / 'iter_0000001'}" in log and "nothing to do" in log
