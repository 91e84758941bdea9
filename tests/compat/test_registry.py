"""compat.registry: every patch declares its versions, and a mismatch is reported once with
what happens to the patch."""

import warnings

import pytest

from dpo_megatron.compat import patches
from dpo_megatron.compat.registry import Patch, check_installed


def test_every_patch_is_declared_and_matches_this_environment():
    """Each module of the package declares one patch under its own name, has its own test file,
    and was written for the installed versions."""
    import os

    from dpo_megatron.compat.registry import patch_modules

    names = [p.name for p in patches()]
    assert names == patch_modules()
    assert {"cuda_on_cpu", "moe_expert_fc2_bias", "mla_without_te"} <= set(names)
    tests = os.path.dirname(os.path.abspath(__file__))
    for name in names:
        assert os.path.isfile(os.path.join(tests, f"test_{name}.py")), name
    for patch in patches():
        assert patch.why and patch.switched_on and patch.versions
        assert patch.mismatches() == {}, patch.name
        assert patch.applies_to_installed()


def test_a_version_fix_stays_off_on_other_versions_with_one_warning():
    fix = Patch(
        name="some_fix",
        why="a fault of 0.1",
        versions={"megatron-core": "==0.1.*"},
        switched_on="never here",
    )
    assert set(fix.mismatches()) == {"megatron-core"}
    assert not fix.applies_to_installed()
    with pytest.warns(
        RuntimeWarning,
        match=r"some_fix: megatron-core 0\.16\.\d+ \(written for "
        r"==0\.1\.\*\); the patch stays off",
    ):
        check_installed(fix)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_installed(fix) == []  # once per patch


def test_an_indispensable_patch_stays_on_unverified():
    needed = Patch(
        name="needed_one",
        why="x",
        versions={"torch": "<1"},
        switched_on="always",
        off_on_other_versions=False,
    )
    assert needed.applies_to_installed()
    with pytest.warns(RuntimeWarning, match="stays on, unverified on this version"):
        check_installed(needed)


def test_a_missing_distribution_counts_as_a_mismatch():
    patch = Patch(
        name="needs_te",
        why="x",
        versions={"transformer-engine-nonexistent": ">=1"},
        switched_on="x",
    )
    assert patch.mismatches() == {"transformer-engine-nonexistent": ("not installed", ">=1")}
