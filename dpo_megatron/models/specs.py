"""Layer specs (megatron-core ``ModuleSpec``) of the supported architectures.

One local spec covers them all, switched by the ModelConfig: RMSNorm or LayerNorm (SP-aware,
``models.norms``), fused SDPA core attention (``models.attention``), Qwen3's query/key RMSNorm
(``qk_layernorm``) or OLMo's over the whole projection, DeepSeek-V3's multi-latent attention
(``models.mla``), megatron-core's MoE layer with this engine's router (``models.moe``; dense
layers first where ``model.moe_first_dense_layers`` says so), GPT-NeoX's parallel-residual layer
and OLMo's post-norm layer (``models.layers``).
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from dpo_megatron.models.attention import core_attention_spec, resolve_local_attention
from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.context_attention import ContextParallelAttention
from dpo_megatron.models.layers import (
    LayerTypeRopeSelfAttention,
    ParallelResidualTransformerLayer,
    PostNormTransformerLayer,
)
from dpo_megatron.models.mla import DPOMLASelfAttention
from dpo_megatron.models.moe import DPOTopKRouter
from dpo_megatron.models.norms import (
    KeyProjectionRMSNorm,
    ProjectionRMSNorm,
    norm_class,
)
from dpo_megatron.models.transformer_config import use_transformer_engine


def uses_transformer_engine(model: ModelConfig) -> bool:
    """Whether this model is built with the transformer-engine spec. Mixture-of-experts and
    parallel-residual models are built with the local spec (their layers are wired for it);
    ``transformer_impl=auto`` then picks it.

    Raises:
        ValueError: ``transformer_impl=transformer_engine`` for such a model, or as
            :func:`use_transformer_engine`.
    """
    te = use_transformer_engine(model.transformer_impl)
    local_only = [
        name
        for name, on in (
            ("model.num_experts", model.num_experts),
            ("model.kv_lora_rank", model.kv_lora_rank is not None),
            ("model.parallel_residual", model.parallel_residual),
            ("model.sliding_window", model.sliding_window is not None),
            ("model.norm_placement", model.norm_placement != "pre"),
            ("model.norm_weight_offset", model.norm_weight_offset),
            ("model.local_rotary_base", model.local_rotary_base is not None),
            ("model.qk_norm_scope=projection", model.qk_norm_scope == "projection"),
            ("model.attention_sinks", model.attention_sinks),
            ("model.rope_yarn_factor", model.rope_yarn_factor is not None),
        )
        if on
    ]
    if te and local_only:
        if model.transformer_impl == "transformer_engine":
            raise ValueError(
                f"model.transformer_impl=transformer_engine is not wired for "
                f"{' / '.join(local_only)}: use model.transformer_impl=local"
            )
        return False
    return te


def core_attention_choice(model: ModelConfig, context_parallel_size: int) -> tuple[str, str]:
    """The core attention this model's layers run, as :func:`layer_spec` builds them, and why:
    ``(name, reason)`` for the start-up line (``training.auto_settings``). Under context
    parallelism the local spec's layers attend with the blockwise kernel of
    ``models.context_attention`` whatever ``model.local_attention`` names.

    Raises:
        ValueError: as :func:`uses_transformer_engine` and
            ``models.attention.resolve_local_attention``.
    """
    if uses_transformer_engine(model):
        return "transformer-engine", f"model.transformer_impl={model.transformer_impl}"
    if context_parallel_size > 1:
        why = f"CP {context_parallel_size}: gathers the keys and values"
        if model.local_attention != "auto":
            why += f"; model.local_attention={model.local_attention} applies without CP"
        return "context-parallel blockwise", why
    kernel = resolve_local_attention(model.local_attention)
    if model.local_attention == "auto":
        return kernel, f"auto: {kernel} on {'CUDA' if kernel == 'flex' else 'this device'}"
    return kernel, "set in the config"


def layer_spec(model: ModelConfig, config: TransformerConfig, vp_stage: int | None) -> ModuleSpec:
    """Transformer-block spec: TE layers when chosen (their attention does context parallelism
    itself), else local layers with SP-aware norms and, under context parallelism,
    ``models.context_attention.ContextParallelAttention``."""
    if uses_transformer_engine(model):
        layer = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
        layer.submodules.self_attention.submodules.core_attention = core_attention_spec(
            model.local_attention, transformer_engine=True
        )
        return layer
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    # Experts of each layer this stage builds (global index offset + i); DeepSeek-V3's first
    # model.moe_first_dense_layers layers have a dense MLP.
    experts = [
        model.num_experts if offset + i >= model.moe_first_dense_layers else None
        for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))
    ]
    specs = {n: _local_layer(model, config, n) for n in set(experts)}
    layers = [specs[n] for n in experts]
    norm = norm_class(model.normalization, model.norm_weight_offset)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm),
    )


def _local_layer(model: ModelConfig, config: TransformerConfig, num_experts: int | None):
    """One local-spec layer: with ``num_experts`` an MoE layer, else a dense MLP."""
    mla = model.kv_lora_rank is not None
    layer = get_gpt_layer_local_spec(
        num_experts=num_experts,
        qk_layernorm=model.qk_layernorm or mla,  # MLA: its latent norms sit in these slots
        normalization=model.normalization,
        multi_latent_attention=mla,
    )
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = (
        ContextParallelAttention
        if config.context_parallel_size > 1  # gathers keys/values
        else core_attention_spec(model.local_attention, transformer_engine=False)
    )
    norm = norm_class(model.normalization, model.norm_weight_offset)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    if mla:  # DeepSeek-V3: RMSNorms over the query and key/value latents, SP-aware
        layer.submodules.self_attention.module = DPOMLASelfAttention
        attention.q_layernorm = norm if model.q_lora_rank is not None else IdentityOp
        attention.kv_layernorm = norm
    elif model.qk_layernorm and model.qk_norm_scope == "projection":  # OLMo 2 / 3
        attention.q_layernorm = ProjectionRMSNorm
        attention.k_layernorm = KeyProjectionRMSNorm
    elif model.qk_layernorm:  # Qwen3 / Gemma 3: RMSNorm over head_dim, whatever the layer norm
        head_norm = norm_class("RMSNorm", model.norm_weight_offset)
        attention.q_layernorm = head_norm
        attention.k_layernorm = head_norm
    if model.local_rotary_base is not None:  # Gemma 3: the windowed layers' own RoPE
        layer.submodules.self_attention.module = LayerTypeRopeSelfAttention
    if num_experts:
        layer.submodules.mlp.submodules.router = DPOTopKRouter
    if model.parallel_residual:
        layer.module = ParallelResidualTransformerLayer
    if model.norm_placement == "post":  # OLMo 2 / 3: norms on the branch outputs only
        layer.submodules.input_layernorm = IdentityOp
        layer.submodules.pre_mlp_layernorm = IdentityOp
    if model.norm_placement in ("post", "sandwich"):  # Gemma 2 / 3: before and after
        layer.module = PostNormTransformerLayer
        layer.params = {**(layer.params or {}), "norm": norm}
    return layer
