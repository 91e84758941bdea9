"""Which rank this is, and the few collectives checkpoint code needs, all callable without a
process group (world 1) and, for the rank, before one exists (from torchrun's ``RANK``).

Every checkpoint decision (a file failed its checksum, a save failed on one rank) must be the
same on every rank, or the ranks part ways and the next collective hangs: each rank's finding
is gathered to all ranks, and each rank decides on the same list.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _process_group():
    """``torch.distributed`` when a process group is up, else None. Read from ``sys.modules``:
    a process that has not imported torch has no process group, and the launchers' early
    checks stay free of the torch import."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def rank() -> int:
    """Global rank: the process group's, else torchrun's ``RANK`` (0 without either)."""
    dist = _process_group()
    return dist.get_rank() if dist is not None else int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    """True on global rank 0 (and in a process without a process group or ``RANK``): the rank
    that prints and writes the run's shared files."""
    return rank() == 0


def world_size() -> int:
    """Global world size (1 without a process group)."""
    dist = _process_group()
    return dist.get_world_size() if dist is not None else 1


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    dist = _process_group()
    if dist is not None:
        dist.barrier()


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (collective)."""
    dist = _process_group()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (collective)."""
    dist = _process_group()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_errors(error: str | None) -> list[str]:
    """The distinct non-empty error messages of all ranks, each prefixed with the ranks that
    raised it (``"rank 0, 1: ..."``; no prefix in a world of one), the same list on every rank
    (collective)."""
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(gather_to_all(error)):
        if e:
            by_message.setdefault(e, []).append(r)
    if world_size() == 1:
        return list(by_message)
    return [f"rank {', '.join(map(str, ranks))}: {e}" for e, ranks in by_message.items()]
