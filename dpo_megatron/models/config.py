"""The model's architecture and numerics, as one typed config (Llama family + GPT-2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
    """Transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: int = 128
    """Width of the MLP's intermediate layer (per branch for SwiGLU)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention (None: one per query head)."""
    kv_channels: Optional[int] = None
    """Head dimension (None: hidden_size / num_attention_heads)."""
    pad_attention_heads: bool = False
    """When TP does not divide the key/value heads (SmolLM2-135M: 9 query / 3 KV heads at TP 2),
    add all-zero key/value groups (with their query heads) up to a multiple of
    ``pad_attention_heads_multiple``. Zero heads contribute exactly nothing and receive zero
    gradient; conversion drops them on export. False: such a layout is an error."""
    pad_attention_heads_multiple: int = 2
    """With pad_attention_heads: round the key/value groups up to a multiple of this, whatever
    the TP size, so checkpoint shapes do not depend on the layout they were saved at (SmolLM2:
    3 -> 4 groups, usable at TP 1, 2 and 4). TP must divide the padded count."""
    vocab_size: int = 256
    """Tokenizer vocabulary; padded up to a multiple of make_vocab_size_divisible_by x TP."""
    make_vocab_size_divisible_by: int = 1
    """Padding granule for the vocabulary (x TP). 1 keeps HF's size whenever TP divides it."""
    max_position_embeddings: int = 2048
    """Longest sequence the position encoding is built for (tokens)."""
    position_embedding_type: str = "rope"
    """'rope' (Llama family) or 'learned_absolute' (GPT-2)."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling_factor: Optional[float] = None
    """Llama-3.1 style RoPE frequency scaling factor (None: no scaling)."""
    rope_linear_scaling_factor: Optional[float] = None
    """Llama-2 style linear RoPE scaling (position interpolation, Chen et al. 2023): positions
    are divided by this factor (HF ``rope_type: linear``). None: no interpolation."""
    normalization: str = "RMSNorm"
    """'RMSNorm' (Llama) or 'LayerNorm' (GPT-2)."""
    norm_epsilon: float = 1e-5
    """Epsilon inside the norm's square root."""
    activation: str = "swiglu"
    """'swiglu' (gated SiLU, Llama) or 'gelu' (GPT-2, tanh approximation)."""
    add_bias_linear: bool = False
    """Biases on all linear layers (GPT-2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2)."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output layer's weight."""
    init_method_std: float = 0.02
    """Std of the normal init for random weights."""
    params_dtype: str = "auto"
    """'auto' (bf16 with CUDA, fp32 on CPU), 'float32' or 'bfloat16'."""
    transformer_impl: str = "auto"
    """'auto' (transformer-engine spec when it imports and CUDA exists, else local), 'local'
    or 'transformer_engine'."""
    local_attention: str = "sdpa"
    """Core attention of the local spec (``models.attention``): 'sdpa' (torch's fused
    scaled_dot_product_attention: causal for padded rows, one call per sequence for packed rows;
    no [s, s] scores or masks kept; CPU and GPU), 'flex' (torch FlexAttention block masks for
    packed rows, compiled on CUDA; forward-only on CPU), 'auto' (flex on CUDA, else sdpa) or
    'megatron' (megatron-core's unfused DotProductAttention with a dense mask: the reference).
    Ignored with transformer-engine (THD packed sequences)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: None, 'full' or 'selective' (megatron-core)."""
    recompute_method: Optional[str] = None
    """With 'full': 'uniform' or 'block'."""
    recompute_num_layers: Optional[int] = None
    """With 'full': layers per recompute group."""
