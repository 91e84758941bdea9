"""The other names users give a loss, and the ``loss`` config section with its registered names.

The loss registry (``dpo_megatron.losses.registry``) resolves these names when it builds a loss;
the config tree replaces them when a config is built (``config.DPOConfig``), so that the run,
its ``config.yaml`` and ``--print-config`` all read the registered name. Imports nothing: the
config is built before torch is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LOSS_ALIASES: dict[str, str] = {"dpo": "sigmoid"}
"""Other names users give a loss (``loss.name=dpo`` is Rafailov et al.'s sigmoid loss, as in
TRL's ``loss_type="sigmoid"``) -> the registered name."""


def canonical_loss_name(name: str) -> str:
    """The registered name for ``name`` (itself, or what an alias stands for)."""
    return LOSS_ALIASES.get(name, name)


def canonical_loss_section(section: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the ``loss`` section with ``name`` (one name, or each of a list of names) as
    its registered name, as text; a section without ``name`` is copied as it is (the config's
    validation reports it)."""
    out = dict(section)
    if "name" in out:
        name = out["name"]
        out["name"] = (
            [canonical_loss_name(str(n)) for n in name]
            if isinstance(name, (list, tuple))
            else canonical_loss_name(str(name))
        )
    return out
