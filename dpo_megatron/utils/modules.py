"""Module wrappers."""

from __future__ import annotations


def unwrap(module):
    """The model inside ``module``'s wrappers (DDP, Float16Module: each holds the next as
    ``.module``); a bare module is returned as is."""
    while hasattr(module, "module"):
        module = module.module
    return module
