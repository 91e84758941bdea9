"""megatron-core model construction and checkpoint conversion. Knows nothing about losses."""

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.gpt import DPOGPTModel, build_model_chunks
from dpo_megatron.models.transformer_config import build_transformer_config
from dpo_megatron.models.conversion import export_hf, load_hf_weights, model_config_from_hf

__all__ = ["DPOGPTModel", "ModelConfig", "build_model_chunks", "build_transformer_config", "export_hf",
           "load_hf_weights", "model_config_from_hf"]
