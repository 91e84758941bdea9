"""Hugging Face checkpoints in and out of megatron-core models at any TP x PP layout.

- :func:`model_config_from_hf`: ModelConfig from an HF folder's config.json.
- :func:`load_hf_weights`: an HF folder's weights into this rank's live model chunks.
- :func:`check_hf_weights`: an HF folder's weight files against its config.json, headers only
  (the launchers' pre-check).
- :func:`export_hf`: live model chunks (any layout) -> an HF folder (collective; LoRA merged).
- :func:`export_peft_adapter`: a LoRA policy's adapters -> a PEFT adapter folder (collective).
- :func:`~dpo_megatron.models.conversion.layout.converter_layout`: the layout an offline
  converter runs at, checked before megatron-core starts.

Architectures and their tensor tables: :mod:`dpo_megatron.models.conversion.architectures`.
"""

from dpo_megatron.models.conversion.architectures import ARCHITECTURES
from dpo_megatron.models.conversion.export import export_hf, export_peft_adapter
from dpo_megatron.models.conversion.hf_config import model_config_from_hf
from dpo_megatron.models.conversion.load import check_hf_weights, load_hf_weights

__all__ = [
    "ARCHITECTURES",
    "check_hf_weights",
    "export_hf",
    "export_peft_adapter",
    "model_config_from_hf",
    "load_hf_weights",
]
