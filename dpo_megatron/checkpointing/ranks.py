"""The few collectives checkpoint code needs, also callable without a process group (world 1).

Every checkpoint decision (a file failed its checksum, a save failed on one rank) must be the
same on every rank, or the ranks part ways and the next collective hangs: each rank's finding
is gathered to all ranks, and each rank decides on the same list.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Global world size (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (collective)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (collective)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_errors(error: Optional[str]) -> list[str]:
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
