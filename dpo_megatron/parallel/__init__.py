"""Process groups, the device, communication. Knows nothing about DPO.

``config`` (ParallelConfig, no heavy imports), ``device`` (the engine's device and the host ->
device boundary), ``layout`` (process groups and seeding), ``shutdown`` (how a rank stops: signals
agreed over the ranks, the launcher's death), ``host_malloc`` (the host allocator's tunables).
"""

from dpo_megatron.parallel.config import ParallelConfig

__all__ = ["ParallelConfig", "initialize_distributed", "destroy_distributed", "set_seed"]


def __getattr__(name):  # the layout functions import torch: only when asked for
    if name in ("initialize_distributed", "destroy_distributed", "set_seed"):
        from dpo_megatron.parallel import layout

        return getattr(layout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
