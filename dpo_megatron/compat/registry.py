"""The list of patches and the version check every one of them goes through.

A patch is a workaround for a torch or megatron-core behaviour that this engine cannot change
from outside. Each patch module declares one :class:`Patch`: why it exists, the package versions
it was written and tested for, and whether it may run on other versions. :func:`check_installed`
compares those versions with the installed ones once, when the ``compat`` package is imported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclass(frozen=True)
class Patch:
    """One workaround, described.

    Attributes:
        name: short identifier (the module name).
        why: the behaviour it works around, and where it bites.
        versions: distribution name -> PEP 440 specifier the patch was written and tested for
            (e.g. ``{"megatron-core": "==0.16.*"}``).
        switched_on: when it is applied (a sentence, for the docs and the start-up report).
        off_on_other_versions: True for a fix of a version-specific fault (it stays off on other
            versions: the fault may be gone, and a patch of changed code would break it). False
            for a patch the run cannot do without (the CPU redirection): it stays on, with a
            warning that it was not verified on the installed version.
    """

    name: str
    why: str
    versions: dict[str, str] = field(default_factory=dict)
    switched_on: str = ""
    off_on_other_versions: bool = True

    def mismatches(self) -> dict[str, tuple[str, str]]:
        """distribution -> (installed version, expected specifier) where they disagree."""
        out = {}
        for dist, spec in self.versions.items():
            installed = installed_version(dist)
            if installed is None or Version(installed) not in SpecifierSet(spec):
                out[dist] = (installed or "not installed", spec)
        return out

    def applies_to_installed(self) -> bool:
        """True when the installed versions are the patch's, or the patch runs on any."""
        return not self.off_on_other_versions or not self.mismatches()


_REGISTRY: dict[str, Patch] = {}


def register(patch: Patch) -> Patch:
    """Add a patch to the registry and check its versions (each patch module calls this once,
    at import, so the check runs whenever the patch can be used)."""
    _REGISTRY[patch.name] = patch
    check_installed(patch)
    return patch


def patch_modules() -> list[str]:
    """Every patch module of the package, by name: each module of ``dpo_megatron.compat`` but
    this one (read from the package folder, so a new patch cannot be left out of the list)."""
    import pkgutil
    from pathlib import Path

    folder = str(Path(__file__).parent)
    return sorted(m.name for m in pkgutil.iter_modules([folder]) if m.name != "registry")


def patches() -> list[Patch]:
    """Every patch of the package, by name (imports all patch modules)."""
    import importlib

    for name in patch_modules():
        importlib.import_module(f"dpo_megatron.compat.{name}")
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


@cache
def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution (``"megatron-core"``), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


_WARNED: set[str] = set()


def check_installed(*checked: Patch) -> list[str]:
    """Warn once per patch whose versions differ from the installed ones; returns the warnings.

    Args:
        checked: the patches to check (default: all of them).

    The warning says what happens: a version-specific fix stays off, an indispensable patch stays
    on unverified. Either way the patch's own test (``tests/compat``) is the place to look.
    """
    messages = []
    for patch in checked or patches():
        bad = patch.mismatches()
        if not bad or patch.name in _WARNED:
            continue
        found = ", ".join(f"{d} {v} (written for {s})" for d, (v, s) in bad.items())
        effect = (
            "stays off" if patch.off_on_other_versions else "stays on, unverified on this version"
        )
        message = (
            f"dpo_megatron.compat.{patch.name}: {found}; the patch {effect}. "
            f"See tests/compat/test_{patch.name}.py."
        )
        _WARNED.add(patch.name)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        messages.append(message)
    return messages
