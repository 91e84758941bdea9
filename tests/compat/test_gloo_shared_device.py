"""compat.gloo_shared_device: the gloo groups made after ``install`` share the process's one
device, so one event-loop thread serves them all (torch alone starts one per group), and their
collectives still give the right sums."""

from __future__ import annotations

import os

import pytest

from tests.multirank import run_ranks


def _loop_threads() -> int:
    """gloo's TCP event-loop threads of this process (one per gloo device)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


def _groups_before_and_after_install() -> dict:
    import torch
    import torch.distributed as dist

    from dpo_megatron.compat.gloo_shared_device import PATCH, install

    assert PATCH.applies_to_installed()
    dist.init_process_group("gloo")
    plain = [dist.new_group([0, 1]) for _ in range(3)]
    before = _loop_threads()  # torch: the default group's device and one per new group
    assert install() and install()  # idempotent
    shared = [dist.new_group([0, 1]) for _ in range(4)] + [dist.new_group([1])]
    after = _loop_threads()
    sums = []
    for group in plain + shared[:4]:
        x = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(x, group=group)
        sums.append(x.tolist())
    one = torch.full((2,), 5.0)
    if dist.get_rank() == 1:
        dist.all_reduce(one, group=shared[4])
    dist.destroy_process_group()
    return {"before": before, "after": after, "sums": sums, "one": one.tolist()}


@pytest.mark.slow
def test_groups_made_after_install_add_no_event_loop_thread():
    for rank in run_ranks(_groups_before_and_after_install, world_size=2):
        assert rank["before"] == 4, rank  # the fault: one loop thread per group
        assert rank["after"] == rank["before"] + 1, rank  # five new groups, one shared device
        assert rank["sums"] == [[3.0, 3.0, 3.0]] * 7
        assert rank["one"] == [5.0, 5.0]
