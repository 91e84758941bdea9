"""Python's cyclic garbage collector around a process's start-up.

Importing torch, megatron-core, transformers and datasets creates a few hundred thousand
objects, and the collector walks all of them again and again while they arrive: a large share
of the import time (measured: ``docs/BENCHMARKS.md``). Every
launch pays it in each of its processes (the pre-check, torchrun's agent, every rank), so entry
points pause the collector before their heavy imports (:func:`pause`). A run's rank resumes it
once the run is built (:func:`resume_after_setup`): one collection frees what set-up left in
reference cycles, and what is left lives for the whole run, so it is frozen out of the
collector's view; the full collections megatron-core forces at every checkpoint save and load
(``gc.collect()`` in the distributed optimizer's ``sharded_state_dict``) then walk only what the
steps made, not every object of the imports.
"""

from __future__ import annotations

import gc


def pause() -> None:
    """No automatic cyclic collection from here on (reference counting still frees at once
    everything that is not in a cycle)."""
    gc.disable()


def resume_after_setup() -> None:
    """Collect once, freeze the survivors (they are never walked again) and collect
    automatically from here on. Safe when :func:`pause` was not called."""
    gc.collect()
    gc.freeze()
    gc.enable()
