"""The reference DPO repo's policy.pt: loaded safely, turned into an HF folder our importer reads
with the same log-probs as the HF model it came from, and written back in the same layout."""

import argparse
import os

import pytest
import torch

from dpo_megatron.checkpointing.dpo_repo_archive import (
    ArchiveError,
    archive_to_hf_folder,
    hf_folder_to_archive,
    load_policy_archive,
    save_policy_archive,
)
from tests.checkpointing.faults import Payload
from tests.models.conversion_helpers import (
    build_tiny_hf_model,
    hf_logps,
    pipeline_logits,
    save_tiny_hf_folder,
    token_logps,
)
from tests.multirank import run_ranks


def _engine_logits(hf_dir, input_ids):
    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig()
    initialize_distributed(parallel)
    set_seed(1234)
    cfg = model_config_from_hf(
        hf_dir, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, hf_dir)
    return pipeline_logits(chunks, input_ids)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])  # tied GPT-2; untied Pythia
def test_policy_pt_gives_the_hf_models_logps(tmp_path, arch):
    """policy.pt written as the reference repo writes it (a torch.save of {'step_idx', 'state':
    HF state_dict, 'metrics'}) of model B, over a base folder holding model A of the same
    architecture: the engine's per-token log-probs equal model B's within 1e-5 (relative)."""
    base = save_tiny_hf_folder(arch, str(tmp_path / "base"), seed=0)
    trained = build_tiny_hf_model(arch, seed=1)
    archive = str(tmp_path / "LATEST" / "policy.pt")
    torch.save(
        {"step_idx": 640, "state": trained.state_dict(), "metrics": {"loss": 1.5}},
        str(tmp_path / "policy_plain.pt"),
    )
    save_policy_archive(archive, trained.state_dict(), step_idx=640, metrics={"loss": 1.5})
    state, info = load_policy_archive(str(tmp_path / "policy_plain.pt"))
    assert info == {"step_idx": 640, "metrics": {"loss": 1.5}}
    assert all(torch.equal(state[k], v) for k, v in trained.state_dict().items())

    folder = archive_to_hf_folder(archive, base, str(tmp_path / "hf"))
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, trained.config.vocab_size, (2, 12), generator=g)
    expected = hf_logps(trained, input_ids, torch.ones_like(input_ids))
    logits = run_ranks(_engine_logits, world_size=1, hf_dir=folder, input_ids=input_ids)[0]
    got = token_logps(logits[..., : trained.config.vocab_size], input_ids)
    rel = ((got - expected).abs() / expected.abs()).max().item()
    assert rel <= 1e-5, rel
    base_logps = hf_logps(build_tiny_hf_model(arch, seed=0), input_ids, torch.ones_like(input_ids))
    assert (base_logps - expected).abs().max() > 1e-2  # the archive's weights, not the base's

    # and back: our HF export -> policy.pt holds the same tensors
    again = hf_folder_to_archive(folder, str(tmp_path / "again" / "policy.pt"), step_idx=8)
    state, info = load_policy_archive(again)
    assert info["step_idx"] == 8
    for name, tensor in trained.state_dict().items():
        assert torch.equal(state[name], tensor), name


class _Payload:
    """An object whose unpickling would run code (writes a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_objects_are_refused_naming_the_file(tmp_path):
    sd = {"w": torch.zeros(2)}
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"step_idx": 0, "state": sd, "metrics": {}, "x": _Payload(str(marker))}, str(evil))
    with pytest.raises(
        ArchiveError,
        match=rf"model.archive={evil}: refused: the file holds a "
        r"pickled object other than tensors",
    ):
        load_policy_archive(str(evil))
    # os.mkdir (torch 2.13 words its refusal of posix.* "module posix is blocked"): the same
    # refusal, naming what the file would call
    mkdir = tmp_path / "mkdir.pt"
    torch.save({"step_idx": 0, "state": sd, "x": Payload(str(marker))}, str(mkdir))
    with pytest.raises(
        ArchiveError,
        match=r"refused: the file holds a pickled object .* calls "
        r"posix\.mkdir, and loading it would run that code",
    ):
        load_policy_archive(str(mkdir))
    assert not marker.exists()  # nothing in the files ran

    # argparse.Namespace is a safe global once megatron-core is imported (it registers it for its
    # own checkpoints): still refused here, with megatron-core imported or not
    config_obj = tmp_path / "with_namespace.pt"
    torch.save({"state": sd, "config": argparse.Namespace(lr=1.0)}, str(config_obj))
    for megatron in (False, True):
        if megatron:
            import megatron.core.dist_checkpointing  # noqa: F401
        with pytest.raises(ArchiveError, match="refused.*Namespace"):
            load_policy_archive(str(config_obj))

    with pytest.raises(ArchiveError, match=r"expected the reference repo's layout.*\['model'\]"):
        torch.save({"model": sd}, str(tmp_path / "other.pt"))
        load_policy_archive(str(tmp_path / "other.pt"))
    with pytest.raises(ArchiveError, match=r"state\['w'\] is a list, not a tensor"):
        torch.save({"state": {"w": [1.0]}}, str(tmp_path / "list.pt"))
        load_policy_archive(str(tmp_path / "list.pt"))
    with pytest.raises(ArchiveError, match="no such file"):
        load_policy_archive(str(tmp_path / "absent.pt"))
    # Garbage and a cut file are damage, not a security refusal (no torch advice to load with
    # weights_only=False either)
    (tmp_path / "garbage.pt").write_text("garbage")
    good = tmp_path / "good.pt"
    torch.save({"step_idx": 0, "state": sd, "metrics": {}}, str(good))
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for name in ("garbage.pt", "cut.pt"):
        with pytest.raises(
            ArchiveError,
            match=r"not a readable torch.save file \(corrupt, "
            r"truncated or another format\)",
        ) as info:
            load_policy_archive(str(tmp_path / name))
        assert "refused" not in str(info.value) and "weights_only" not in str(info.value)


def test_archive_of_another_model_is_refused(tmp_path):
    base = save_tiny_hf_folder("gpt2", str(tmp_path / "base"))
    other = build_tiny_hf_model("llama")
    save_policy_archive(str(tmp_path / "policy.pt"), other.state_dict(), 0)
    with pytest.raises(
        ArchiveError, match=r"does not fit .*GPT2LMHeadModel.*missing \['transformer"
    ):
        archive_to_hf_folder(str(tmp_path / "policy.pt"), base, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
