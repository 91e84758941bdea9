"""The model's architecture and numerics, as one typed config (Llama family + GPT-2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dpo_megatron.config_checks import check_choice, check_range

POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
LOCAL_ATTENTIONS = ("sdpa", "megatron")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")

MODEL_PRESETS: dict[str, dict] = {
    # SmolLM2-135M-Instruct from the offline asset cache (dpo_megatron.assets); its 3 key/value
    # heads are padded to 4 so that TP 1, 2 and 4 all fit and checkpoints reshard.
    "smollm2": {"hf_path": "${asset:smollm2}", "pad_attention_heads": True},
}
"""``model=NAME`` (command line) or ``model: NAME`` (YAML) stands for these ``model.*`` keys;
later ``model.*`` overrides still apply on top. Any other scalar given to ``model`` is an error
that lists these names."""


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer, in megatron-core's terms.

    When ``hf_path`` is set the architecture fields are derived from that folder's
    ``config.json`` (``dpo_megatron.models.conversion``) and the weights are loaded from it; the
    values here are then ignored. Without it they describe a randomly initialised model.
    """

    hf_path: str = ""
    """Hugging Face folder (config.json + safetensors) to take architecture and weights from."""
    load: str = ""
    """megatron-core distributed checkpoint to load the weights from instead (e.g. an SFT run)."""
    num_layers: int = 2
    """Transformer layers (>= 1)."""
    hidden_size: int = 64
    """Width of the residual stream (>= 1)."""
    ffn_hidden_size: int = 128
    """Width of the MLP's intermediate layer (per branch for SwiGLU; >= 1)."""
    num_attention_heads: int = 4
    """Query heads (>= 1)."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention (>= 1, dividing the query heads; None: one per
    query head)."""
    kv_channels: Optional[int] = None
    """Head dimension (>= 1; None: hidden_size / num_attention_heads)."""
    pad_attention_heads: bool = False
    """When TP does not divide the key/value heads (SmolLM2-135M: 9 query / 3 KV heads at TP 2),
    add all-zero key/value groups (with their query heads) up to a multiple of
    ``pad_attention_heads_multiple``. Zero heads contribute exactly nothing and receive zero
    gradient; conversion drops them on export. False: such a layout is an error."""
    pad_attention_heads_multiple: int = 2
    """With pad_attention_heads: round the key/value groups up to a multiple of this (>= 1),
    whatever the TP size, so checkpoint shapes do not depend on the layout they were saved at (SmolLM2:
    3 -> 4 groups, usable at TP 1, 2 and 4). TP must divide the padded count."""
    vocab_size: int = 256
    """Tokenizer vocabulary (>= 1); padded up to a multiple of make_vocab_size_divisible_by x TP."""
    make_vocab_size_divisible_by: int = 1
    """Padding granule for the vocabulary (x TP; >= 1). 1 keeps HF's size whenever TP divides it."""
    max_position_embeddings: int = 2048
    """Longest sequence the position encoding is built for (tokens, >= 1)."""
    position_embedding_type: str = "rope"
    """'rope' (Llama family) or 'learned_absolute' (GPT-2)."""
    rotary_base: float = 10000.0
    """RoPE theta (> 0)."""
    rope_scaling_factor: Optional[float] = None
    """Llama-3.1 style RoPE frequency scaling factor (> 0; None: no scaling)."""
    rope_linear_scaling_factor: Optional[float] = None
    """Llama-2 style linear RoPE scaling (position interpolation, Chen et al. 2023): positions
    are divided by this factor (> 0; HF ``rope_type: linear``). None: no interpolation."""
    normalization: str = "RMSNorm"
    """'RMSNorm' (Llama) or 'LayerNorm' (GPT-2)."""
    norm_epsilon: float = 1e-5
    """Epsilon inside the norm's square root (> 0)."""
    activation: str = "swiglu"
    """'swiglu' (gated SiLU, Llama) or 'gelu' (GPT-2, tanh approximation)."""
    add_bias_linear: bool = False
    """Biases on all linear layers (GPT-2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2)."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output layer's weight."""
    init_method_std: float = 0.02
    """Std of the normal init for random weights (> 0)."""
    params_dtype: str = "auto"
    """'auto' (bf16 with CUDA, fp32 on CPU), 'float32' or 'bfloat16'."""
    transformer_impl: str = "auto"
    """'auto' (transformer-engine spec when it imports and CUDA exists, else local), 'local'
    or 'transformer_engine'."""
    local_attention: str = "sdpa"
    """Core attention of the local spec: 'sdpa' (torch's fused scaled_dot_product_attention: no
    [b, heads, s, s] scores kept, ~5x faster on CPU) or 'megatron' (megatron-core's
    DotProductAttention, unfused). Ignored with transformer-engine."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: None, 'full' or 'selective' (megatron-core)."""
    recompute_method: Optional[str] = None
    """With 'full': 'uniform' or 'block'."""
    recompute_num_layers: Optional[int] = None
    """With 'full': layers per recompute group (>= 1)."""

    def validate(self) -> None:
        """Ranges of every field: sizes and counts >= 1 (``num_query_groups``, ``kv_channels``,
        ``recompute_num_layers``: >= 1 or null); ``rotary_base``, ``norm_epsilon``,
        ``init_method_std`` and the RoPE scaling factors > 0; the names one of the module's
        tuples above. The architecture against the layout (heads / TP, layers / PP), the
        activation and the dtype name are checked with the layout, before launch, by
        ``models.transformer_config.build_transformer_config``.

        Raises:
            ValueError: ``model.<field>=<value> must be ...``.
        """
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "pad_attention_heads_multiple", "vocab_size", "make_vocab_size_divisible_by",
                     "max_position_embeddings"):
            check_range("model", self, name, 1)
        for name in ("num_query_groups", "kv_channels", "recompute_num_layers"):
            check_range("model", self, name, 1, optional=True)
        for name in ("rope_scaling_factor", "rope_linear_scaling_factor"):
            check_range("model", self, name, 0, low_open=True, optional=True)
        check_range("model", self, "rotary_base", 0, low_open=True)
        check_range("model", self, "norm_epsilon", 0, low_open=True)
        check_range("model", self, "init_method_std", 0, low_open=True)
        check_choice("model", self, "position_embedding_type", POSITION_EMBEDDING_TYPES)
        check_choice("model", self, "normalization", NORMALIZATIONS)
        check_choice("model", self, "transformer_impl", TRANSFORMER_IMPLS)
        check_choice("model", self, "local_attention", LOCAL_ATTENTIONS)
        check_choice("model", self, "recompute_granularity", RECOMPUTE_GRANULARITIES,
                     optional=True)
        check_choice("model", self, "recompute_method", RECOMPUTE_METHODS, optional=True)
