"""Checkpoints of model weights (megatron-core distributed format), loadable at any layout."""

from dpo_megatron.checkpointing.model_checkpoint import (
    load_model_checkpoint,
    load_model_config,
    save_model_checkpoint,
)

__all__ = ["save_model_checkpoint", "load_model_checkpoint", "load_model_config"]
