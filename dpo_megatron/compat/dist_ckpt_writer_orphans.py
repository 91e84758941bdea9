"""megatron-core's checkpoint writer processes end with the rank that forked them.

megatron-core 0.16's ``torch_dist`` writer (``FileSystemWriterAsync``) forks one process per
write bucket at every save, synchronous ones included (``write_preloaded_data_multiproc``,
``thread_count=2`` buckets by default). A fork does not inherit the rank's parent-death signal
(:func:`dpo_megatron.parallel.shutdown.die_with_launcher`), so when the launcher is killed with
SIGKILL during a save the rank dies and its writers live on: seen in the kill -9 test, a writer
still alive well after its rank, writing into ``iter_N.tmp``; one whose results outgrow its
queue's pipe would block in its queue's feeder thread for ever, since nobody reads it. With the
patch each writer asks the kernel, first thing, for SIGKILL when its rank dies.

Switched on before every synchronous distributed-checkpoint save, on megatron-core 0.16 only.
"""

from __future__ import annotations

from dpo_megatron.compat.registry import Patch, register
from dpo_megatron.utils.processes import die_with_parent

PATCH = register(
    Patch(
        name="dist_ckpt_writer_orphans",
        why="megatron-core 0.16's torch_dist save forks writer processes that outlive a rank "
        "killed mid-save (no parent-death signal across fork)",
        versions={"megatron-core": "==0.16.*"},
        switched_on="before each synchronous distributed-checkpoint save",
    )
)


def writers_die_with_their_rank() -> bool:
    """Wrap the writer processes' entry function so that each one dies with its parent;
    returns True when the patch is applied (idempotent)."""
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    original = FileSystemWriterAsync.write_preloaded_data  # a staticmethod: the plain function
    if getattr(original, "dies_with_its_rank", False):
        return True

    def write_preloaded_data(*args, **kwargs):
        die_with_parent()
        return original(*args, **kwargs)

    write_preloaded_data.dies_with_its_rank = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)
    return True
