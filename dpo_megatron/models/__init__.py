"""megatron-core model construction and checkpoint conversion. Knows nothing about losses."""

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.gpt import build_model_chunks, build_transformer_config
from dpo_megatron.models.conversion import export_hf, load_hf_weights, model_config_from_hf

__all__ = ["ModelConfig", "build_model_chunks", "build_transformer_config", "export_hf",
           "load_hf_weights", "model_config_from_hf"]
