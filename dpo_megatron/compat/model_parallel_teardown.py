"""Tear megatron-core's model-parallel groups down for real, keeping the default group.

megatron-core 0.16's ``parallel_state.destroy_model_parallel`` only drops its references to the
groups it built (it destroys just its gloo data-parallel groups): every other group keeps its
communicator, two threads per peer on gloo, for the life of the process, and its list of groups
(``_global_process_group_list``) keeps growing. A process that switches layouts between phases
(the online loop: policy layout for sampling and training, the reward model's for scoring) would
pile them up. Here the groups megatron-core listed are destroyed after its own teardown.

Switched on when a run switches layouts in one process, on megatron-core 0.16 only (elsewhere
plain ``destroy_model_parallel``).
"""

from __future__ import annotations

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="model_parallel_teardown",
        why="megatron-core 0.16's destroy_model_parallel leaves its process groups alive (gloo: "
        "two threads per peer each), so switching layouts in one process piles them up",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a run switches parallel layouts in one process (online DPO phases)",
    )
)


def destroy_model_parallel() -> int:
    """megatron-core's ``destroy_model_parallel``, then (on 0.16) every group it had created
    on this rank destroyed; the default process group stays. Returns the groups destroyed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    groups = []
    if PATCH.applies_to_installed():
        groups = [g for g in (ps._global_process_group_list or []) if g is not None]
    ps.destroy_model_parallel()
    destroyed = 0
    for group in groups:
        if group is dist.GroupMember.WORLD or group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            dist.destroy_process_group(group)
            destroyed += 1
        except (ValueError, RuntimeError):  # already destroyed (megatron-core's gloo DP groups)
            pass
    if PATCH.applies_to_installed():
        ps._global_process_group_list = None
    return destroyed
