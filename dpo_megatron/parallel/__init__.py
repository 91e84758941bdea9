"""Process groups, communication and the CPU compatibility layer. Knows nothing about DPO."""

from dpo_megatron.parallel.layout import (
    ParallelConfig,
    destroy_distributed,
    initialize_distributed,
    set_seed,
)

__all__ = ["ParallelConfig", "initialize_distributed", "destroy_distributed", "set_seed"]
