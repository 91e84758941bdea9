"""One table per Hugging Face architecture: HF tensor names <-> megatron-core names, and how each
tensor is split across tensor-parallel ranks; plus the HF config.json <-> ModelConfig translation.

Adding an architecture means adding an :class:`Architecture` to :data:`ARCHITECTURES` (a
config translator and a tensor table); the loader and exporter have no per-architecture code.

One module per concern, in this package: ``base`` (split kinds, :class:`TensorMap`,
:class:`Architecture`, :func:`dims`, the name patterns, config readers the families share), one
module per family (``llama``: also Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, SmolLM3;
``olmo3``; ``gemma3``; ``deepseek_v3``; ``gpt_oss``; ``gpt2``; ``gpt_neox``), and here the table
of all of them. Names and shape symbols: :mod:`dpo_megatron.models.conversion.architectures.base`.

Supported (``model_type``: classes, what differs):

* ``llama`` (Llama 2 / 3.x incl. ``rope_type: llama3`` and ``linear``, SmolLM2), ``mistral``,
  ``qwen2`` (Qwen2 / Qwen2.5: q/k/v biases): one table.
* ``qwen3`` (``Qwen3ForCausalLM``): the Llama table plus per-head query/key RMSNorm; explicit
  ``head_dim``.
* ``qwen3_moe`` (``Qwen3MoeForCausalLM``) and ``mixtral`` (``MixtralForCausalLM``): the Llama
  attention with an MoE layer (router ``gate`` + per-expert SwiGLU MLPs, the per-expert file
  layout transformers writes and the hub holds).
* ``smollm3`` (``SmolLM3ForCausalLM``): the Llama table; the layers HF's ``no_rope_layers``
  marks 0 apply no RoPE (``model.no_rope_layers``); with ``use_sliding_window`` the
  ``sliding_attention`` layers of ``layer_types`` are windowed (``model.sliding_window``).
* ``olmo3`` (``Olmo3ForCausalLM``): the Llama projections; RMSNorms after attention and MLP
  instead of before (``model.norm_placement=post``); query / key RMSNorm over the whole
  projection (``model.qk_norm_scope=projection``, weights split with the heads); sliding windows
  in the ``sliding_attention`` layers of ``layer_types``; one RoPE for both layer types.
* ``gemma3_text`` (``Gemma3ForCausalLM``): the Llama projections with per-head q/k norms; norms
  before and after attention and MLP (``model.norm_placement=sandwich``), all ``(1 + w)``
  RMSNorms (``model.norm_weight_offset``); GeGLU; embeddings scaled by sqrt(hidden); softmax
  scale ``query_pre_attn_scalar ** -0.5``; sliding windows per ``layer_types`` with their own
  RoPE theta (``model.local_rotary_base``).
* ``deepseek_v3`` (``DeepseekV3ForCausalLM``): multi-latent attention (``model.kv_lora_rank``
  and the MLA head sizes), an MoE with dense first layers, a shared expert, sigmoid scores with
  a fixed expert score bias, group-limited top-k and a routed scaling factor.
* ``gpt_oss`` (``GptOssForCausalLM``): the Llama projections with q/k/v/o biases and a
  learnable attention sink per head (``model.attention_sinks``), sliding windows in the
  ``sliding_attention`` layers of ``layer_types``, YaRN RoPE, an MoE in every layer with a
  biased router and biased experts whose clamped SwiGLU is ``model.activation=clamped_swiglu``;
  the experts are stored stacked and interleaved (``gpt_oss.STACKED_EXPERTS``).
* ``gpt2``: learned positions, Conv1D weights.
* ``gpt_neox`` (``GPTNeoXForCausalLM``, Pythia): parallel residual, partial rotary, LayerNorm
  with biases, fused per-head QKV.
"""

from __future__ import annotations

from dpo_megatron.models.conversion.architectures.base import (
    COLUMN,
    GATE_UP,
    QKV,
    REPLICATED,
    ROW,
    SPLITS,
    VOCAB,
    Architecture,
    TensorMap,
    dims,
    expand,
    interleave_rows,
    is_expert_pattern,
    is_layer_pattern,
)
from dpo_megatron.models.conversion.architectures.deepseek_v3 import (
    deepseek_v3_config_from_hf,
    deepseek_v3_config_to_hf,
    deepseek_v3_tensors,
)
from dpo_megatron.models.conversion.architectures.gemma3 import (
    gemma3_config_from_hf,
    gemma3_config_to_hf,
    gemma3_tensors,
)
from dpo_megatron.models.conversion.architectures.gpt2 import (
    gpt2_config_from_hf,
    gpt2_config_to_hf,
    gpt2_tensors,
)
from dpo_megatron.models.conversion.architectures.gpt_neox import (
    gpt_neox_config_from_hf,
    gpt_neox_config_to_hf,
    gpt_neox_tensors,
)
from dpo_megatron.models.conversion.architectures.gpt_oss import (
    STACKED_EXPERTS,
    gpt_oss_config_from_hf,
    gpt_oss_config_to_hf,
    gpt_oss_tensors,
)
from dpo_megatron.models.conversion.architectures.llama import (
    LLAMA_IGNORED,
    llama_config_from_hf,
    llama_config_to_hf,
    llama_tensors,
    mixtral_tensors,
    qwen3_moe_tensors,
)
from dpo_megatron.models.conversion.architectures.olmo3 import (
    olmo3_config_from_hf,
    olmo3_config_to_hf,
    olmo3_tensors,
)

__all__ = [
    "ARCHITECTURES",
    "COLUMN",
    "GATE_UP",
    "QKV",
    "REPLICATED",
    "ROW",
    "SPLITS",
    "VOCAB",
    "Architecture",
    "TensorMap",
    "dims",
    "expand",
    "get_architecture",
    "interleave_rows",
    "is_expert_pattern",
    "is_layer_pattern",
]

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "llama",
        "LlamaForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        llama_tensors,
        "model.",
        LLAMA_IGNORED,
    ),
    "mistral": Architecture(
        "mistral",
        "MistralForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        llama_tensors,
        "model.",
        LLAMA_IGNORED,
    ),
    "qwen2": Architecture(
        "qwen2",
        "Qwen2ForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        llama_tensors,
        "model.",
        LLAMA_IGNORED,
    ),
    "qwen3": Architecture(
        "qwen3",
        "Qwen3ForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        llama_tensors,
        "model.",
    ),
    # SmolLM3: the Llama table; every no_rope_layer_interval-th layer applies no RoPE.
    "smollm3": Architecture(
        "smollm3",
        "SmolLM3ForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        llama_tensors,
        "model.",
    ),
    "qwen3_moe": Architecture(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        qwen3_moe_tensors,
        "model.",
    ),
    "mixtral": Architecture(
        "mixtral",
        "MixtralForCausalLM",
        llama_config_from_hf,
        llama_config_to_hf,
        mixtral_tensors,
        "model.",
        LLAMA_IGNORED,
    ),
    "olmo3": Architecture(
        "olmo3",
        "Olmo3ForCausalLM",
        olmo3_config_from_hf,
        olmo3_config_to_hf,
        olmo3_tensors,
        "model.",
    ),
    "gemma3_text": Architecture(
        "gemma3_text",
        "Gemma3ForCausalLM",
        gemma3_config_from_hf,
        gemma3_config_to_hf,
        gemma3_tensors,
        "model.",
    ),
    "deepseek_v3": Architecture(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        deepseek_v3_config_from_hf,
        deepseek_v3_config_to_hf,
        deepseek_v3_tensors,
        "model.",
    ),
    "gpt_oss": Architecture(
        "gpt_oss",
        "GptOssForCausalLM",
        gpt_oss_config_from_hf,
        gpt_oss_config_to_hf,
        gpt_oss_tensors,
        "model.",
        file_layout=STACKED_EXPERTS,
    ),
    "gpt2": Architecture(
        "gpt2",
        "GPT2LMHeadModel",
        gpt2_config_from_hf,
        gpt2_config_to_hf,
        gpt2_tensors,
        "transformer.",
        ("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias"),
    ),
    # Checkpoints written by older transformers (the Pythia files on the hub) also hold the
    # causal-mask and rotary buffers.
    "gpt_neox": Architecture(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        gpt_neox_config_from_hf,
        gpt_neox_config_to_hf,
        gpt_neox_tensors,
        "gpt_neox.",
        (
            "gpt_neox.layers.{i}.attention.bias",
            "gpt_neox.layers.{i}.attention.masked_bias",
            "gpt_neox.layers.{i}.attention.rotary_emb.inv_freq",
        ),
    ),
}


NOT_MAPPED: dict[str, str] = {
    **dict.fromkeys(
        ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        "its gated DeltaNet layers cannot run here: megatron-core 0.16.1's GatedDeltaNet needs "
        "flash-linear-attention's Triton kernel (chunk_gated_delta_rule), Triton has no CPU "
        "driver, and the layer serves neither packed sequences nor generation",
    ),
}
"""Architectures asked for that are known not to be served, with the reason (refused by name
rather than as an unknown type)."""


def get_architecture(model_type: str, source: str = "config.json") -> Architecture:
    """The table for HF ``model_type``.

    Raises:
        ValueError: naming the unknown (or known but not mapped: :data:`NOT_MAPPED`, with the
            reason) type, where it came from, and the supported ones.
    """
    if model_type in NOT_MAPPED:
        raise ValueError(
            f"{source}: model_type={model_type!r} is not supported: {NOT_MAPPED[model_type]}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{source}: unknown architecture model_type={model_type!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[model_type]
