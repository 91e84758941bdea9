"""megatron-core model construction and checkpoint conversion. Knows nothing about losses.

The names below are imported on first use, so that ``dpo_megatron.models.config`` (the config
tree's ``model`` section, read by the launcher's config check) costs no megatron-core import.
"""

from importlib import import_module

_EXPORTS = {
    "ModelConfig": "dpo_megatron.models.config",
    "ScoringGPTModel": "dpo_megatron.models.gpt",
    "build_model_chunks": "dpo_megatron.models.gpt",
    "build_transformer_config": "dpo_megatron.models.transformer_config",
    "export_hf": "dpo_megatron.models.conversion",
    "load_hf_weights": "dpo_megatron.models.conversion",
    "model_config_from_hf": "dpo_megatron.models.conversion",
}

__all__ = [
    "ScoringGPTModel",
    "ModelConfig",
    "build_model_chunks",
    "build_transformer_config",
    "export_hf",
    "load_hf_weights",
    "model_config_from_hf",
]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
