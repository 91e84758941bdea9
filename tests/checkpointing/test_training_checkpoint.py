"""Finding, choosing and pruning training checkpoints (no model: folders and files only)."""

from __future__ import annotations

import json

import pytest

from dpo_megatron.checkpointing.training_checkpoint import (
    checkpoint_name,
    find_latest_checkpoint,
    is_complete_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resolve_resume,
)


def _fake_checkpoint(folder, complete: bool = True):
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text("{}")
    if complete:
        (folder / "train_state.json").write_text(json.dumps({"step": 1}))
    return folder


@pytest.fixture
def save_dir(tmp_path):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path / checkpoint_name(step))
    _fake_checkpoint(tmp_path / "iter_0000008.tmp")  # killed while saving (renamed last)
    _fake_checkpoint(tmp_path / "iter_0000010", complete=False)  # no train_state.json
    (tmp_path / "hf").mkdir()
    return tmp_path


def test_checkpoint_name():
    assert checkpoint_name(0) == "iter_0000000"
    assert checkpoint_name(1234) == "iter_0001234"


def test_only_complete_checkpoints_count(save_dir):
    assert [step for step, _ in list_checkpoints(str(save_dir))] == [2, 4, 6]
    assert find_latest_checkpoint(str(save_dir)) == str(save_dir / "iter_0000006")
    assert is_complete_checkpoint(str(save_dir / "iter_0000004"))
    assert not is_complete_checkpoint(str(save_dir / "iter_0000008.tmp"))
    assert not is_complete_checkpoint(str(save_dir / "iter_0000010"))
    assert list_checkpoints(str(save_dir / "missing")) == []


def test_resolve_resume(save_dir, tmp_path_factory):
    latest = str(save_dir / "iter_0000006")
    assert resolve_resume("none", str(save_dir)) is None
    assert resolve_resume("", str(save_dir)) is None
    assert resolve_resume("auto", str(save_dir)) == latest
    assert resolve_resume("auto", str(tmp_path_factory.mktemp("empty"))) is None
    assert resolve_resume(str(save_dir), "unused") == latest  # a folder of checkpoints
    explicit = str(save_dir / "iter_0000002")
    assert resolve_resume(explicit, "unused") == explicit
    with pytest.raises(FileNotFoundError, match="no complete training checkpoint"):
        resolve_resume(str(save_dir / "iter_0000010"), "unused")


def test_prune_keeps_the_newest(save_dir):
    removed = prune_checkpoints(str(save_dir), keep_last_n=2)
    assert removed == [str(save_dir / "iter_0000002")]
    assert [s for s, _ in list_checkpoints(str(save_dir))] == [4, 6]
    assert prune_checkpoints(str(save_dir), keep_last_n=0) == []  # 0 keeps everything
    assert (save_dir / "iter_0000010").exists()  # incomplete folders are not counted or removed


def _run_checkpoint(folder, step: int, run_id):
    _fake_checkpoint(folder / checkpoint_name(step))
    (folder / checkpoint_name(step) / "train_state.json").write_text(
        json.dumps({"step": step, "run_id": run_id})
    )


def test_prune_removes_only_checkpoints_of_the_current_run(tmp_path):
    """An older run's higher iterations are not 'newer' checkpoints of this run: pruning never
    touches them (nor checkpoints without an id), and keeps this run's newest."""
    for step in (5, 6, 7):
        _run_checkpoint(tmp_path, step, "old-run")
    _run_checkpoint(tmp_path, 8, None)
    for step in (1, 2, 3):
        _run_checkpoint(tmp_path, step, "new-run")
    removed = prune_checkpoints(str(tmp_path), keep_last_n=2, run_id="new-run")
    assert removed == [str(tmp_path / "iter_0000001")]
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 3, 5, 6, 7, 8]


def test_resume_candidates_newest_first(save_dir):
    from dpo_megatron.checkpointing.training_checkpoint import resume_candidates

    assert resume_candidates("auto", str(save_dir)) == [
        str(save_dir / checkpoint_name(s)) for s in (6, 4, 2)
    ]
    assert resume_candidates("none", str(save_dir)) == []
    assert resume_candidates(str(save_dir / "iter_0000002"), "unused") == [
        str(save_dir / "iter_0000002")
    ]


class _State:
    """A stateful object that records what it is given back."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_a_resume_gives_back_every_state_entry_a_save_wrote(monkeypatch):
    """``resume_run`` restores every name of ``STATE_ENTRIES`` (an entry added there, as
    docs/EXTENDING.md says, comes back, not only the sampler and the loss), and a checkpoint
    without one of them stops in one line naming the entry and the checkpoint."""
    from dpo_megatron.checkpointing import run_checkpoint

    monkeypatch.setattr(run_checkpoint, "STATE_ENTRIES", ("scheduler", "sampler", "loss", "ema"))
    saved = {
        "scheduler": {"value": 1},
        "sampler": {"value": 2},
        "loss": {"value": 3},
        "ema": {"value": 4},
        "counters": {"step": 5, "skipped_steps": 0, "consecutive_skipped": 0},
    }
    monkeypatch.setattr(run_checkpoint, "load_training_checkpoint", lambda *a, **k: dict(saved))
    states = {name: _State(0) for name in ("model", "optimizer", *run_checkpoint.STATE_ENTRIES)}
    counters, _ = run_checkpoint.resume_run("ckpt", states, use_distributed_optimizer=False)
    assert counters.step == 5
    assert {n: states[n].value for n in run_checkpoint.STATE_ENTRIES} == {
        "scheduler": 1,
        "sampler": 2,
        "loss": 3,
        "ema": 4,
    }
    del saved["ema"]
    with pytest.raises(ValueError, match=r"^ckpt: train_state.json holds no 'ema' state$"):
        run_checkpoint.resume_run("ckpt", states, use_distributed_optimizer=False)


def test_a_random_initialisation_is_redrawn_only_by_the_sizes_that_shape_it(tmp_path, monkeypatch):
    """Resuming a run that started from random weights warns that its reference is re-drawn
    only when the layout draws other weights: a pipeline, virtual-pipeline, tensor- or
    expert-parallel size changed; a data- or context-parallel change (the same weights on every
    replica) or the optimizer's format does not."""
    from dpo_megatron.checkpointing import run_checkpoint

    saved = {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": None,
        "data_parallel_size": 2,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
        "world_size": 4,
        "use_distributed_optimizer": True,
    }
    monkeypatch.setattr(run_checkpoint, "read_train_state", lambda path: {"layout": saved})
    cases = [
        ({}, False),
        ({"data_parallel_size": 1, "world_size": 2}, False),
        ({"context_parallel_size": 2, "data_parallel_size": 1}, False),
        ({"use_distributed_optimizer": False}, False),
        ({"pipeline_model_parallel_size": 1, "data_parallel_size": 4}, True),
        ({"virtual_pipeline_model_parallel_size": 2}, True),
        ({"tensor_model_parallel_size": 2, "data_parallel_size": 1}, True),
        ({"expert_model_parallel_size": 2}, True),
    ]
    for change, redrawn in cases:
        now = {**saved, **change}
        monkeypatch.setattr(run_checkpoint, "current_layout", lambda _: now)
        assert run_checkpoint.redraws_random_init(str(tmp_path), True) is redrawn, change


def test_a_checkpoint_from_before_expert_parallelism_resumes_at_its_own_layout(monkeypatch):
    """train_state.json of versions before expert parallelism has no expert sizes in its layout
    (simulated: today's layout without them). Resumed at the same dense layout it is the same
    layout: no resharding note, no re-drawn reference and (the same comparison in
    load_training_checkpoint) its RNG states restored. It read as resharded
    (expert_model_parallel_size None -> 1)."""
    from dpo_megatron.checkpointing import run_checkpoint, training_checkpoint

    now = {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "data_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 2,
        "world_size": 2,
        "use_distributed_optimizer": True,
    }
    old = {k: v for k, v in now.items() if not k.startswith("expert_")}
    monkeypatch.setattr(run_checkpoint, "read_train_state", lambda path: {"layout": old})
    monkeypatch.setattr(run_checkpoint, "current_layout", lambda _: now)
    assert run_checkpoint.layout_note("ckpt", True) is None
    assert run_checkpoint.redraws_random_init("ckpt", True) is False
    assert training_checkpoint.saved_layout({"layout": old}) == now
    # a real change still reads as one
    monkeypatch.setattr(
        run_checkpoint, "current_layout", lambda _: {**now, "data_parallel_size": 2}
    )
    assert run_checkpoint.layout_note("ckpt", True) == (
        "resharding ckpt (data_parallel_size 1 -> 2); RNG states start fresh"
    )
