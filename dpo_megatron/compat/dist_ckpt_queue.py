"""Synchronous ``torch_dist`` checkpoint saves without a spawned ``multiprocessing`` Manager.

megatron-core 0.16's ``torch_dist`` writer hands write results to the caller through a queue
that it creates, once per process, from a ``multiprocessing`` Manager started with the *spawn*
method: a new Python process that re-imports the entry module (torch, megatron-core: seconds per
rank, and a hang when the entry script lacks an ``if __name__ == "__main__":`` guard). In a
synchronous save the producer is the saving process itself, so an in-process queue does the same
job. Asynchronous saves (not used by this engine) would need the Manager.

Switched on before every synchronous distributed-checkpoint save, on megatron-core 0.16 only.
"""

from __future__ import annotations

import queue

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="dist_ckpt_queue",
        why="megatron-core 0.16's synchronous torch_dist save starts a spawn Manager (slow, and it "
        "hangs when the entry module has no __main__ guard)",
        versions={"megatron-core": "==0.16.*"},
        switched_on="before each synchronous distributed-checkpoint save",
    )
)


def use_in_process_results_queue() -> bool:
    """Give the writer a plain in-process queue; returns True when the patch is applied."""
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return True
