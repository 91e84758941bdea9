"""Checkpoint integrity on a real training checkpoint (tiny model, one rank): the manifest lists
every file, verification names the file a corruption hit, and a pickle payload planted in each
kind of pickled file is refused without running (the manifest rewritten to match, so the refusal
comes from the pickle scan, not the checksum)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch

from dpo_megatron.checkpointing.integrity import (
    HASH_NAME,
    MANIFEST_FILE,
    UnsafeCheckpointError,
    file_digest,
    load_weights_only,
    verify_checkpoint,
)
from tests.checkpointing.faults import (
    flip_bytes,
    payload_bytes,
    plant_in_dcp_item,
    plant_in_dcp_metadata,
    plant_in_pt_file,
)
from tests.engine import random_pairs, tiny_trainer
from tests.multirank import run_ranks


def _one_step_checkpoint(run_dir):
    trainer = tiny_trainer(
        random_pairs(4, 0, lambda i: (3, 2, 2)), run_dir=run_dir, steps=1, model={"num_layers": 2}
    )
    trainer.train()
    return trainer.checkpointer.latest()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    return run_ranks(_one_step_checkpoint, world_size=1, run_dir=str(root / "run"))[0]


@pytest.fixture
def ckpt(saved, tmp_path):
    copy = tmp_path / "iter_0000001"
    shutil.copytree(saved, copy)
    return str(copy)


def test_manifest_lists_every_file_with_size_and_digest(ckpt):
    manifest = json.loads(open(os.path.join(ckpt, MANIFEST_FILE)).read())
    files = manifest["files"]
    assert {
        ".metadata",
        "common.pt",
        "metadata.json",
        "model_config.json",
        "train_state.json",
        "rng/rank_00000.pt",
    } <= set(files)
    assert any(name.endswith(".distcp") for name in files)
    for name, entry in files.items():
        assert (entry["size"], entry[HASH_NAME]) == file_digest(os.path.join(ckpt, name))
    assert manifest["total_bytes"] == sum(e["size"] for e in files.values())
    v = verify_checkpoint(ckpt)
    assert v.problems == [] and v.files == len(files) and v.bytes == manifest["total_bytes"]


def test_streamed_digest_equals_the_one_shot_digest(tmp_path):
    import xxhash

    data = os.urandom((9 << 20) + 3)  # crosses the 8 MiB read size
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_digest(str(path)) == (len(data), xxhash.xxh3_128(data).hexdigest())


def test_each_corruption_names_its_file(ckpt):
    distcp = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]
    flip_bytes(os.path.join(ckpt, distcp))  # 4 KiB flipped in a shard: same size
    with open(os.path.join(ckpt, "common.pt"), "r+b") as f:
        f.truncate(100)
    os.remove(os.path.join(ckpt, "model_config.json"))
    open(os.path.join(ckpt, "extra.bin"), "wb").write(b"x")
    problems = verify_checkpoint(ckpt).problems
    assert any(p.startswith(f"{distcp}: {HASH_NAME} digest") for p in problems), problems
    assert any(p.startswith("common.pt: 100 bytes, the manifest says") for p in problems)
    assert "model_config.json: missing" in problems
    assert "extra.bin: not in the manifest (added after the save)" in problems


def test_unreadable_manifest_and_legacy_checkpoint(ckpt):
    os.remove(os.path.join(ckpt, MANIFEST_FILE))
    legacy = verify_checkpoint(ckpt)
    assert legacy.problems == [] and not legacy.has_manifest  # saved before manifests
    assert "has no manifest.json (saved before checksums)" in legacy.report(ckpt)
    open(os.path.join(ckpt, MANIFEST_FILE), "w").write("{not json")
    assert verify_checkpoint(ckpt).problems[0].startswith(f"{MANIFEST_FILE}: unreadable")


@pytest.mark.parametrize("kind", ["dcp_metadata", "common.pt", "rng", "byte_item"])
def test_a_planted_payload_is_refused_and_never_runs(ckpt, tmp_path, kind):
    marker = str(tmp_path / f"PAYLOAD_RAN_{kind}")
    if kind == "dcp_metadata":
        plant_in_dcp_metadata(ckpt, marker)
        where = ".metadata: refused global posix.mkdir"
    elif kind == "common.pt":
        plant_in_pt_file(ckpt, "common.pt", marker)
        where = "common.pt: holds objects other than tensors"
    elif kind == "rng":
        plant_in_pt_file(ckpt, "rng/rank_00000.pt", marker)
        where = "rng/rank_00000.pt: holds objects other than tensors"
    else:
        distcp = plant_in_dcp_item(ckpt, marker, byte_item=True)
        where = f"{distcp}: item "
    v = verify_checkpoint(ckpt)
    assert v.unsafe and any(p.startswith(where) for p in v.problems), v.problems
    with pytest.raises(UnsafeCheckpointError, match="failed verification"):
        v.raise_if_failed(ckpt)
    assert not os.path.exists(marker)
    # The payload is real: loading the same bytes without weights_only runs it.
    torch.load(io.BytesIO(payload_bytes(marker)), weights_only=False)
    assert os.path.isdir(marker)


def test_rng_states_are_tensors_and_plain_containers(ckpt):
    """The RNG file loads with weights_only=True; NumPy's state is a tensor of its 624-word key,
    restored exactly (as is the tuple older checkpoints stored)."""
    import numpy as np

    from dpo_megatron.checkpointing.training_checkpoint import set_numpy_state

    state = load_weights_only(os.path.join(ckpt, "rng", "rank_00000.pt"))
    keys = state["numpy"]["keys"]
    assert isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and keys.numel() == 624
    assert isinstance(state["torch"], torch.Tensor) and state["python"][0] == 3
    set_numpy_state(state["numpy"])
    expected = np.random.rand(3)
    set_numpy_state(state["numpy"])
    assert (np.random.rand(3) == expected).all()
    legacy = np.random.get_state()
    first = np.random.rand(2)
    set_numpy_state(legacy)
    assert (np.random.rand(2) == first).all()


def test_weights_only_refuses_the_payload(tmp_path):
    marker = str(tmp_path / "ran")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(payload_bytes(marker)), weights_only=True)
    assert not os.path.exists(marker)
