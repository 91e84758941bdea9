"""The model's architecture and numerics, as one typed config (Llama / Qwen families, GPT-2,
GPT-NeoX, and mixture-of-experts models)."""

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
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (GPT-NeoX ``rotary_pct``: Pythia
    rotates the first 25%); the rest pass through unrotated."""
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
    """'swiglu' (gated SiLU, Llama), 'gelu' (GPT-2: the tanh approximation, HF ``gelu_new``) or
    'gelu_exact' (the erf form, HF ``gelu``: GPT-NeoX / Pythia)."""
    add_bias_linear: bool = False
    """Biases on all linear layers (GPT-2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2)."""
    qk_layernorm: bool = False
    """RMSNorm over each head's query and key vectors before RoPE (Qwen3; weights of size
    ``kv_channels`` shared by all heads)."""
    parallel_residual: bool = False
    """GPT-NeoX's parallel residual: attention and MLP both read the layer input,
    ``x + attn(ln1(x)) + mlp(ln2(x))`` (``dpo_megatron.models.layers``). False: the sequential
    pre-norm layer ``h = x + attn(ln1(x)); h + mlp(ln2(h))``."""
    num_experts: Optional[int] = None
    """Mixture of experts: routed experts per layer, every layer (megatron-core's MoE layer;
    Mixtral, Qwen3-MoE). None: dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """Intermediate width of one expert (Qwen3-MoE ``moe_intermediate_size``); None:
    ffn_hidden_size."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE
    ``norm_topk_prob``). False: the top-k entries of the softmax over all experts."""
    moe_aux_loss_coeff: Optional[float] = None
    """Weight of the router's load-balancing loss (Fedus et al. 2021, eq. 4) in the training
    objective, on transformers' scale: ``E * sum_e f_e P_e`` with ``f_e`` the fraction of routing
    choices sent to expert e, averaged over the layers (``dpo_megatron.models.moe``). None: the HF
    config's ``router_aux_loss_coef`` (0 for a model without ``hf_path``). 0 switches it off.
    It lives here, not under ``loss.``: the routers compute it inside the model, and the
    preference losses never see it."""
    moe_token_dispatcher: str = "alltoall"
    """How tokens reach experts on other expert-parallel ranks: 'alltoall' (all-to-all of the
    routed tokens only) or 'allgather' (every rank gathers every token). Both run on gloo and
    NCCL."""
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
    """Core attention of the local spec: 'sdpa' (torch's fused scaled_dot_product_attention: no
    [b, heads, s, s] scores kept, ~5x faster on CPU) or 'megatron' (megatron-core's
    DotProductAttention, unfused). Ignored with transformer-engine."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: None, 'full' or 'selective' (megatron-core)."""
    recompute_method: Optional[str] = None
    """With 'full': 'uniform' or 'block'."""
    recompute_num_layers: Optional[int] = None
    """With 'full': layers per recompute group."""
