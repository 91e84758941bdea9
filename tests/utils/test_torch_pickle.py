"""utils.torch_pickle: a torch.save file is refused from its pickle's opcodes when it would call
anything beyond tensors (nothing of it unpickled), damage is told apart from danger, and files
of tensors load as torch.load loads them."""

import collections
import os
import pickle

import pytest
import torch

from dpo_megatron.utils.torch_pickle import (
    UnreadableTorchFileError,
    UnsafePickleError,
    file_globals,
    is_tensor_global,
    load_tensor_file,
)
from tests.checkpointing.faults import Payload


def _state() -> collections.OrderedDict:
    """Tensors of the kinds a state_dict holds: fp32, bf16, int8, a Parameter, a strided view."""
    return collections.OrderedDict(
        w=torch.arange(6.0).view(2, 3),
        b=torch.ones(3, dtype=torch.bfloat16),
        q=torch.tensor([1, -2], dtype=torch.int8),
        p=torch.nn.Parameter(torch.full((2,), 0.5)),
        col=torch.arange(4.0).view(2, 2)[:, 1],
    )


def test_a_payload_is_refused_from_its_opcodes_and_never_runs(tmp_path):
    """``os.mkdir`` pickled in every form a file may take: torch.save's zip (protocol 2:
    ``GLOBAL posix mkdir``, which torch 2.13's refusal words as "module posix is blocked"),
    the legacy torch.save format, and a plain ``pickle.dump`` at protocol 5 (``STACK_GLOBAL`` of
    memoized strings); each is refused naming ``posix.mkdir``, before anything is unpickled."""
    marker = str(tmp_path / "PAYLOAD_RAN")
    files = {
        "zip.pt": lambda p: torch.save({"state": _state(), "x": Payload(marker)}, p),
        "legacy.pt": lambda p: torch.save(
            {"x": Payload(marker)}, p, _use_new_zipfile_serialization=False
        ),
        "plain.pkl": lambda p: open(p, "wb").write(
            pickle.dumps([{"a": 1}, Payload(marker)], protocol=5)
        ),
    }
    for name, write in files.items():
        path = str(tmp_path / name)
        write(path)
        for mmap in (False, True):
            with pytest.raises(UnsafePickleError) as info:
                load_tensor_file(path, mmap=mmap)
            assert info.value.globals == ["posix.mkdir"], name
            assert str(info.value).startswith(f"{path}: refused: its pickle calls posix.mkdir")
            assert "weights_only" not in str(info.value)
    assert not os.path.exists(marker)
    # The payload is real: unpickling the plain file runs it.
    with open(tmp_path / "plain.pkl", "rb") as f:
        pickle.load(f)
    assert os.path.isdir(marker)


def test_files_of_tensors_load_as_torch_loads_them(tmp_path):
    blob = {"state": _state(), "step_idx": 3, "metrics": {"loss": 1.5, "name": "x", "t": (1, None)}}
    for name, legacy in (("zip.pt", False), ("legacy.pt", True)):
        path = str(tmp_path / name)
        torch.save(blob, path, _use_new_zipfile_serialization=not legacy)
        assert all(is_tensor_global(g) for g in file_globals(path)), file_globals(path)
        for mmap in (False,) if legacy else (False, True):
            got = load_tensor_file(path, mmap=mmap)
            assert got["step_idx"] == 3 and got["metrics"] == blob["metrics"]
            for key, tensor in blob["state"].items():
                assert got["state"][key].dtype == tensor.dtype, key
                assert torch.equal(got["state"][key], tensor), key
    assert not is_tensor_global("torch.load") and not is_tensor_global("posix.system")
    assert is_tensor_global("torch.bfloat16")
    assert is_tensor_global("torch._utils._rebuild_tensor_v2")


def test_damage_is_told_apart_from_danger(tmp_path):
    """A cut zip, garbage, an empty file, a plain pickle of no tensors, a missing file: each is
    unreadable (never "refused"), and no message repeats torch's advice to load the file
    without weights_only."""
    good = tmp_path / "good.pt"
    torch.save({"state": _state()}, good)
    data = good.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_text("garbage")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=4))
    causes = {
        "cut.pt": "a zip archive cut short or damaged (no end-of-archive record)",
        "garbage.pt": "ValueError:",
        "empty.pt": "EOFError",
        "plain.pkl": "torch's weights-only unpickler refused it",
        "absent.pt": "no such file",
    }
    for name, cause in causes.items():
        path = str(tmp_path / name)
        with pytest.raises(UnreadableTorchFileError) as info:
            load_tensor_file(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and cause in message, message
        assert not isinstance(info.value, UnsafePickleError)
        assert "refused:" not in message and "weights_only" not in message, message
