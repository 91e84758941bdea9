"""Layer specs (megatron-core ``ModuleSpec``) of the supported architectures."""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from dpo_megatron.models.attention import core_attention_spec
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.context_attention import ContextParallelAttention
from dpo_megatron.models.norms import norm_class
from dpo_megatron.models.transformer_config import use_transformer_engine


def layer_spec(model: ModelConfig, config: TransformerConfig, vp_stage: Optional[int]
                ) -> ModuleSpec:
    """Transformer-block spec: TE layers when chosen (their attention does context parallelism
    itself), else local layers with SP-aware norms and, under context parallelism,
    ``models.context_attention.ContextParallelAttention``."""
    if use_transformer_engine(model.transformer_impl):
        layer = get_gpt_layer_with_transformer_engine_spec()
        layer.submodules.self_attention.submodules.core_attention = core_attention_spec(
            model.local_attention, transformer_engine=True)
        return layer
    layer = get_gpt_layer_local_spec(normalization=model.normalization)
    layer.submodules.self_attention.submodules.core_attention = (
        ContextParallelAttention if config.context_parallel_size > 1  # gathers keys/values
        else core_attention_spec(model.local_attention, transformer_engine=False))
    norm = norm_class(model.normalization)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm),
    )
