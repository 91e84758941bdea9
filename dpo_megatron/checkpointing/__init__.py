"""Every checkpoint the engine writes and reads: model weights (megatron-core distributed
format, loadable at any layout: ``model_checkpoint``), training checkpoints
(``training_checkpoint``: model, optimizer, RNG, train state) with their verification
(``integrity``) and atomic storage (``storage``), the loop's checkpoint policy
(``run_checkpoint``: what the train state holds, when to save, what to resume and prune) and the
reference DPO repo's archives (``dpo_repo_archive``)."""

from dpo_megatron.checkpointing.model_checkpoint import (
    load_model_checkpoint,
    load_model_config,
    save_model_checkpoint,
)

__all__ = ["save_model_checkpoint", "load_model_checkpoint", "load_model_config"]
