"""megatron-core model construction and checkpoint conversion. Knows nothing about losses."""

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.gpt import build_model_chunks, build_transformer_config

__all__ = ["ModelConfig", "build_model_chunks", "build_transformer_config"]
