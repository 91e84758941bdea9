"""Frozen copies of a config tree (``utils.frozen``): no field of any section can be assigned,
a changed tree is a ``dataclasses.replace`` and stays frozen, and copies, pickles, equality,
``asdict`` and OmegaConf see the sections they came from."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from omegaconf import OmegaConf

from dpo_megatron.config import DPOConfig, load_config
from dpo_megatron.data.config import PackingConfig
from dpo_megatron.utils.frozen import freeze, is_frozen, thaw


def _config() -> DPOConfig:
    return load_config(None, ["data.path=d.json", "loss.beta=0.25"], check=False)


def test_no_field_of_any_section_can_be_assigned_and_the_original_is_untouched():
    built = _config()
    frozen = freeze(built)
    assert frozen is not built and is_frozen(frozen) and is_frozen(frozen.packing)
    assert isinstance(frozen, DPOConfig) and isinstance(frozen.packing, PackingConfig)
    with pytest.raises(dataclasses.FrozenInstanceError, match="'enabled' of a resolved Packing"):
        frozen.packing.enabled = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.run_dir = "elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        del frozen.train
    built.packing.enabled = True  # the original stays the user's own, and the copy does not see it
    assert frozen.packing.enabled is None and not is_frozen(built)
    assert freeze(frozen) is frozen


def test_a_changed_tree_is_a_replace_and_stays_frozen():
    frozen = freeze(_config())
    changed = dataclasses.replace(
        frozen, run_dir="round_1", packing=PackingConfig(enabled=True, share_prompt=False)
    )
    assert is_frozen(changed) and is_frozen(changed.packing) and is_frozen(changed.model)
    assert (changed.run_dir, changed.packing.enabled) == ("round_1", True)
    assert frozen.run_dir != "round_1" and frozen.packing.enabled is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.packing.share_prompt = True


def test_copies_pickles_equality_and_readers_see_the_same_tree():
    built = _config()
    frozen = freeze(built)
    assert frozen == built and built == frozen
    assert dataclasses.replace(frozen, run_dir="x") != built
    for copied in (copy.deepcopy(frozen), pickle.loads(pickle.dumps(frozen))):
        assert is_frozen(copied) and is_frozen(copied.train) and copied == frozen
    assert dataclasses.asdict(frozen) == dataclasses.asdict(built)
    assert OmegaConf.to_yaml(OmegaConf.structured(frozen)) == OmegaConf.to_yaml(
        OmegaConf.structured(built)
    )
    plain = thaw(frozen)
    assert not is_frozen(plain) and not is_frozen(plain.packing) and plain == built
    plain.packing.enabled = True
    assert frozen.packing.enabled is None
    with pytest.raises(TypeError, match="dataclass instance"):
        freeze({"run_dir": "x"})
