"""One gloo device per process instead of one per process group.

torch's ``ProcessGroupGloo(store, rank, size, timeout)`` (the constructor ``new_group`` and
``init_process_group`` call, ``torch/distributed/distributed_c10d.py``) creates a new gloo TCP
device for every group. Each device runs its own event-loop thread, which wakes every 10 ms
(gloo's ``tcp::Loop``: ``epoll_wait(..., 10)``) whether or not the group is used. megatron-core
builds about 20 groups per rank (tensor, pipeline, data, context, expert, embedding groups and
gloo copies of the data-parallel ones), so every rank of a CPU run carries some 20 loop threads
waking 2,000 times a second; with several ranks per core those wake-ups take a measurable share
of the CPU (``perf``: ``gloo_tcp_loop`` threads; ``docs/BENCHMARKS.md``). gloo's device is the
network endpoint and serves any number of groups (each group's pairs register their sockets with
its one loop), so :func:`install` makes every gloo group built afterwards in this process share one
device, made the way torch makes its default one (``GLOO_SOCKET_IFNAME`` honoured, lazy
connection set-up as ``TORCH_GLOO_LAZY_INIT`` says).

Switched on by :func:`dpo_megatron.parallel.layout.initialize_distributed` before the default
group is made (every backend: under NCCL megatron-core still builds gloo groups for the
distributed optimizer).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="gloo_shared_device",
        why="torch gives every gloo process group its own device, whose event-loop thread wakes "
        "every 10 ms: ~20 groups per megatron-core rank cost 5-8% of a busy CPU in wake-ups",
        versions={"torch": ">=2.13,<2.14"},
        switched_on="by parallel.layout.initialize_distributed, before the first process group",
    )
)

_DEVICE: dict[int, Any] = {}
"""pid -> this process's shared device (a forked child makes its own: a device's loop thread
does not survive a fork)."""


def shared_device():
    """This process's gloo device, made on first use as torch makes a group's default one."""
    import torch.distributed.distributed_c10d as c10d

    pid = os.getpid()
    if pid not in _DEVICE:
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "")
        gloo = c10d.ProcessGroupGloo
        if "," in interface:  # torch makes one device per listed interface: keep its way
            return None
        _DEVICE[pid] = (
            gloo.create_device(interface=interface) if interface else gloo.create_default_device()
        )
    return _DEVICE[pid]


def install() -> bool:
    """Make every gloo group created from now on in this process use :func:`shared_device`.
    Returns whether it is installed (False on other torch versions: their constructor may
    differ). Idempotent."""
    if not PATCH.applies_to_installed():
        return False
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.ProcessGroupGloo, "shares_one_device", False):
        return True
    base = c10d.ProcessGroupGloo

    class SharedDeviceProcessGroupGloo(base):
        """torch's ``ProcessGroupGloo`` built with the process's one device (an instance of the
        base class for every ``isinstance`` check)."""

        shares_one_device = True

        def __init__(self, store, rank: int, size: int, timeout: timedelta | None = None, **kwargs):
            device = shared_device()
            if device is None or kwargs:
                super().__init__(store, rank, size, **({"timeout": timeout} if timeout else {}))
                return
            options = base._Options()
            options._devices = [device]
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceProcessGroupGloo
    return True
