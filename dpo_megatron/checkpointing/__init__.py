"""Every checkpoint the engine writes and reads: model weights (megatron-core distributed
format, loadable at any layout: ``model_checkpoint``), training checkpoints
(``training_checkpoint``: model, optimizer, RNG, train state) with their verification
(``integrity``) and atomic storage (``storage``), the loop's checkpoint policy
(``run_checkpoint``: what the train state holds, when to save, what to resume and prune) and the
reference DPO repo's archives (``dpo_repo_archive``); ``config`` holds the ``checkpoint.*``
config section and imports nothing heavy."""

__all__ = ["save_model_checkpoint", "load_model_checkpoint", "load_model_config"]


def __getattr__(name):  # torch only when asked for: the config tree loads ``config``
    if name in __all__:
        from dpo_megatron.checkpointing import model_checkpoint

        return getattr(model_checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
