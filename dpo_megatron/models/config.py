"""The model's architecture and numerics, as one typed config (Llama / Qwen families, GPT-2,
GPT-NeoX, and mixture-of-experts models)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

# The one preset table lives in ``models/presets.py`` (reference-repo names such as pythia28 and
# pythia69, the small Pythias, smollm2); re-exported here, where ``model=NAME`` looks it up.
from dpo_megatron.models.presets import MODEL_PRESETS, model_preset_keys, preset_name  # noqa: F401
from dpo_megatron.utils.config_checks import check_choice, check_range

POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")
QK_NORM_SCOPES = ("head", "projection")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
LOCAL_ATTENTIONS = ("auto", "sdpa", "flex", "megatron")  # models.attention: the kernels
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe")  # megatron-core's, for these layers
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
HEADS = ("lm", "reward")  # models.gpt: the LM head, or models.reward_head
SOURCE_FIELDS = ("hf_path", "load", "head")
"""Where a model comes from and which head it has (set by its folder, checkpoint or loss)."""
RUN_FIELDS = (
    "params_dtype",
    "transformer_impl",
    "local_attention",
    "fused_lm_head",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
    "init_method_std",
    "make_vocab_size_divisible_by",
    "moe_token_dispatcher",
    "moe_grouped_gemm",
    "moe_aux_loss_coeff",
)
"""How a run builds, computes and trains the model, not what the model is: the run's own
``model.*`` keys, whatever config.json or checkpoint gives the architecture."""
PADDING_FIELDS = ("pad_attention_heads", "pad_attention_heads_multiple")
"""The zero key/value heads added for TP: part of a checkpoint's tensors (so taken from the
checkpoint with its architecture), compared through the groups they make
(:meth:`ModelConfig.stored_query_groups`), not by value."""


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
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (>= 1, dividing the query heads; None: one per
    query head)."""
    kv_channels: int | None = None
    """Head dimension (>= 1; None: hidden_size / num_attention_heads)."""
    pad_attention_heads: bool = False
    """When TP does not divide the key/value heads (SmolLM2-135M: 9 query / 3 KV heads at TP 2),
    add all-zero key/value groups (with their query heads) up to a multiple of
    ``pad_attention_heads_multiple``. Zero heads contribute exactly nothing and receive zero
    gradient; conversion drops them on export. False: such a layout is an error."""
    pad_attention_heads_multiple: int = 2
    """With pad_attention_heads: round the key/value groups up to a multiple of this (>= 1),
    whatever the TP size, so checkpoint shapes do not depend on the layout they were saved at
    (SmolLM2: 3 -> 4 groups, usable at TP 1, 2 and 4). TP must divide the padded count."""
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
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates, in (0, 1] (GPT-NeoX ``rotary_pct``:
    Pythia rotates the first 25%); the rest pass through unrotated."""
    rope_scaling_factor: float | None = None
    """Llama-3.1 style RoPE frequency scaling factor (> 0; None: no scaling)."""
    rope_linear_scaling_factor: float | None = None
    """Llama-2 style linear RoPE scaling (position interpolation, Chen et al. 2023): positions
    are divided by this factor (> 0; HF ``rope_type: linear``). None: no interpolation."""
    no_rope_layers: list[int] | None = None
    """0-based indices of the layers whose attention applies no RoPE ("NoPE" layers: SmolLM3
    leaves every fourth layer unrotated, HF ``no_rope_layers`` holding 0 there); megatron-core's
    ``no_rope_freq``. None or empty: RoPE in every layer."""
    sliding_window: int | None = None
    """Sliding-window attention: a query sees itself and the ``sliding_window - 1`` keys before
    it (HF's ``sliding_window``; >= 1). None: full causal attention. Served by the local ``sdpa``
    kernel only (padded and packed rows, shared prompts); the other kernels, transformer-engine
    and context parallelism refuse it at config time."""
    sliding_window_layers: list[int] | None = None
    """With ``sliding_window``: 0-based indices of the windowed layers (OLMo 3: three of every
    four, HF ``layer_types``); the others attend to the whole sequence. None: every layer."""
    normalization: str = "RMSNorm"
    """'RMSNorm' (Llama) or 'LayerNorm' (GPT-2)."""
    norm_epsilon: float = 1e-5
    """Epsilon inside the norm's square root (> 0)."""
    activation: str = "swiglu"
    """'swiglu' (gated SiLU, Llama), 'geglu' (gated tanh GELU, Gemma), 'gelu' (GPT-2: the tanh
    approximation, HF ``gelu_new``),
    'gelu_exact' (the erf form, HF ``gelu``: GPT-NeoX / Pythia) or 'clamped_swiglu' (gpt-oss's
    experts: ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, l)``, l =
    ``swiglu_limit``; megatron-core's quick-GELU GLU with ``glu_linear_offset=1`` and
    ``activation_func_clamp_value=l``)."""
    swiglu_limit: float = 7.0
    """With ``activation='clamped_swiglu'``: the clamp l (HF gpt-oss ``swiglu_limit``; > 0)."""
    add_bias_linear: bool = False
    """Biases on all linear layers (GPT-2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2)."""
    qk_layernorm: bool = False
    """RMSNorm over each head's query and key vectors before RoPE (Qwen3; weights of size
    ``kv_channels`` shared by all heads)."""
    qk_norm_scope: str = "head"
    """With ``qk_layernorm``: 'head' (Qwen3: one RMSNorm over head_dim, shared by the heads) or
    'projection' (OLMo 2 / 3: one RMSNorm over all heads' queries, and one over the keys, weights
    of size heads x head_dim; ``models.norms.ProjectionRMSNorm``)."""
    norm_placement: str = "pre"
    """Where the layer norms sit: 'pre' (Llama: ``h = x + attn(norm(x))``), 'post' (OLMo 2 /
    3: ``h = x + norm(attn(x))``, likewise the MLP) or 'sandwich' (Gemma 2 / 3: both,
    ``h = x + norm2(attn(norm1(x)))``; ``models.layers.PostNormTransformerLayer``)."""
    norm_weight_offset: bool = False
    """Gemma's RMSNorm: the weight w is stored as an offset and the norm scales by ``1 + w``
    (computed in fp32), in every norm including the query/key norms. False: by w."""
    embedding_scale: float | None = None
    """Multiply the word embeddings by this (Gemma: sqrt(hidden_size), rounded to the model dtype
    first, as transformers does). None: no scaling."""
    attention_sinks: bool = False
    """gpt-oss's attention sinks: one learnable logit per query head joins each query's softmax
    denominator (no value: ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``; HF ``sinks``,
    megatron-core's ``softmax_type='learnable'``). Served by the local ``sdpa`` kernel (padded,
    packed and shared-prompt rows, generation) and the ``megatron`` kernel; ``flex``,
    transformer-engine and context parallelism refuse it at config time."""
    softmax_scale: float | None = None
    """Attention softmax scale (> 0; Gemma 3: ``query_pre_attn_scalar ** -0.5``). None:
    1 / sqrt(head_dim)."""
    local_rotary_base: float | None = None
    """RoPE theta of the sliding-window layers when it differs from ``rotary_base`` (Gemma 3's
    local layers: 10,000, unscaled, against 1,000,000 with linear scaling in its global layers).
    None: every layer uses ``rotary_base`` and its scaling."""
    parallel_residual: bool = False
    """GPT-NeoX's parallel residual: attention and MLP both read the layer input,
    ``x + attn(ln1(x)) + mlp(ln2(x))`` (``dpo_megatron.models.layers``). False: the sequential
    pre-norm layer ``h = x + attn(ln1(x)); h + mlp(ln2(h))``."""
    num_experts: int | None = None
    """Mixture of experts: routed experts per layer, every layer (megatron-core's MoE layer;
    Mixtral, Qwen3-MoE). None: dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Intermediate width of one expert (Qwen3-MoE ``moe_intermediate_size``); None:
    ffn_hidden_size."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE
    ``norm_topk_prob``). False: the top-k entries of the softmax over all experts."""
    moe_aux_loss_coeff: float | None = None
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
    moe_grouped_gemm: bool = False
    """Megatron-LM's ``--moe-grouped-gemm``; only false: the experts run as megatron-core's
    ``SequentialMLP`` (one expert after another). Its grouped-GEMM experts need the
    ``grouped_gemm`` package's CUDA kernels (``GroupedMLP``) or transformer-engine
    (``TEGroupedMLP``), and keep all experts in two fused weights, beside which no per-expert LoRA
    adapter can sit."""
    moe_first_dense_layers: int = 0
    """The first N layers have a dense MLP of ``ffn_hidden_size`` instead of experts (DeepSeek-V3
    ``first_k_dense_replace``; megatron-core's ``moe_layer_freq``). 0: every layer is MoE."""
    moe_shared_expert_ffn_hidden_size: int | None = None
    """Width of the shared expert every token passes through beside its routed experts
    (DeepSeek-V3: ``n_shared_experts * moe_intermediate_size``; >= 1). None: no shared expert."""
    moe_router_score_function: str = "softmax"
    """'softmax' (Mixtral, Qwen3-MoE) or 'sigmoid' (DeepSeek-V3: per-expert sigmoid scores, the
    top-k of them renormalised to sum to 1)."""
    moe_router_expert_bias: bool = False
    """With 'sigmoid' scores: a per-expert bias added to the scores for the choice of experts
    only (DeepSeek-V3 ``e_score_correction_bias``). It is loaded with the weights and kept fixed
    (DPO must route the policy as the reference; megatron-core's bias update rate is 0)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V3 ``n_group``): the experts split into this many equal
    groups, a token chooses among the ``moe_router_group_topk`` groups whose two best scores
    sum highest (>= 1; None: no groups)."""
    moe_router_group_topk: int | None = None
    """Groups a token may choose experts from (DeepSeek-V3 ``topk_group``; >= 1)."""
    moe_routed_scaling_factor: float | None = None
    """The routed experts' weights are multiplied by this (DeepSeek-V3 ``routed_scaling_factor``;
    > 0; None: 1)."""
    kv_lora_rank: int | None = None
    """Multi-latent attention (DeepSeek-V2 / V3, megatron-core's ``MLASelfAttention``): width of
    the compressed key/value latent (>= 1). None: standard multi-head attention. With it the
    head sizes are ``qk_nope_head_dim`` + ``qk_rope_head_dim`` (queries, keys) and
    ``v_head_dim`` (values); ``kv_channels`` and ``num_query_groups`` are unused."""
    q_lora_rank: int | None = None
    """MLA: width of the compressed query latent (>= 1); None: one full-rank query projection."""
    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key dimensions without RoPE (>= 1)."""
    qk_rope_head_dim: int | None = None
    """MLA: per-head query/key dimensions that RoPE rotates (>= 1; the rotated key part is shared
    by all heads). megatron-core rotates them in DeepSeek's interleaved pair order."""
    v_head_dim: int | None = None
    """MLA: per-head value dimensions (>= 1)."""
    rope_yarn_factor: float | None = None
    """YaRN RoPE (Peng et al. 2023; DeepSeek-V3 and gpt-oss ``rope_type: yarn``): the context
    extension factor (> 0); None: plain RoPE. The ``rope_yarn_*`` fields below are HF's
    ``rope_parameters`` of the same names. With multi-latent attention megatron-core's MLA
    applies it; with standard attention (gpt-oss) the layers rotate by megatron-core's YaRN
    table and the cos / sin scale m is folded into the softmax scale (times m ** 2:
    ``models.transformer_config.yarn_attention_factor``)."""
    rope_yarn_original_max_position_embeddings: int = 4096
    """YaRN: the pre-training context length (>= 1)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations per context where the frequency ramp starts (> 0)."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations per context where the frequency ramp ends (> 0)."""
    rope_yarn_mscale: float = 1.0
    """YaRN: cos / sin are scaled by ``m(factor, mscale) / m(factor, mscale_all_dim)`` with
    ``m(s, k) = 0.1 k ln s + 1`` (>= 0)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: also the softmax scale is multiplied by ``m(factor, mscale_all_dim) ** 2`` (>= 0)."""
    rope_yarn_truncate: bool = True
    """YaRN: round the frequency ramp's bounds to whole dimensions (HF ``truncate``)."""
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
    """Core attention of the local spec (``models.attention``): 'sdpa' (torch's fused
    scaled_dot_product_attention: causal for padded rows, one call per sequence for packed rows;
    no [s, s] scores or masks kept; CPU and GPU), 'flex' (torch FlexAttention block masks for
    packed rows, compiled on CUDA; forward-only on CPU), 'auto' (flex on CUDA, else sdpa) or
    'megatron' (megatron-core's unfused DotProductAttention with a dense mask: the reference).
    Ignored with transformer-engine (THD packed sequences)."""
    recompute_granularity: str | None = None
    """Activation recompute: None, 'full' or 'selective' (megatron-core)."""
    recompute_method: str | None = None
    """With 'full': 'uniform' or 'block'."""
    recompute_num_layers: int | None = None
    """With 'full': layers per recompute group (>= 1)."""
    head: str = "lm"
    """What the last stage computes: 'lm' (the LM head: per-token log-probs) or 'reward' (a
    [hidden -> 1] scalar head on each sequence's last token, ``models.reward_head``; no LM
    head is built). A training run sets it from its loss (``LossSpec.model_head``); an HF
    ``*ForSequenceClassification`` folder or a reward model's checkpoint states it."""
    fused_lm_head: bool | None = None
    """null (auto): fused on an accelerator, unfused on the host CPU, where keeping the logits
    was measured faster (``models.gpt.lm_head_is_fused``). true: log-probs straight from the
    hidden states, the LM head a chunk of positions at a time
    (``models.logprobs.vocab_parallel_linear_logps``): no [tokens, V/TP] logits are kept for
    backward, which projects each chunk again (one more LM-head matmul: about 7% of a SmolLM2
    step on CPU). false: the output layer's logits, kept for backward (faster, ~1 GiB more at
    SmolLM2's 49k vocabulary and 2k scored tokens). The log-probs agree to fp32 rounding."""
    recompute_modules: list[str] | None = None
    """With 'selective': the submodules megatron-core recomputes in backward (null: its default,
    ['core_attn']): 'core_attn' (attention of the local 'megatron' kernel; the fused kernels
    keep no scores), 'layernorm' (both norms' outputs dropped after use: a cheap recompute),
    'mlp' (the dense MLP: the largest activations), 'moe' (the MoE layer)."""

    def stored_query_groups(self) -> int:
        """Key/value groups the model's attention parameters hold: ``num_query_groups`` (None:
        one per query head), with ``pad_attention_heads`` rounded up to a multiple of
        ``pad_attention_heads_multiple`` (SmolLM2-135M: 3 -> 4)."""
        groups = self.num_query_groups or self.num_attention_heads
        if self.pad_attention_heads:
            multiple = self.pad_attention_heads_multiple
            return -(-groups // multiple) * multiple
        return groups

    def validate(self) -> None:
        """Ranges of every field: sizes and counts >= 1 (``num_query_groups``, ``kv_channels``,
        ``recompute_num_layers``, ``num_experts``, ``moe_ffn_hidden_size``: >= 1 or null);
        ``rotary_base``, ``norm_epsilon``, ``init_method_std`` and the RoPE scaling factors > 0;
        ``rotary_percent`` in (0, 1]; ``moe_aux_loss_coeff`` >= 0 or null; the names one of the
        module's tuples above. The architecture against the layout (heads / TP, layers / PP), the
        activation and the dtype name are checked with the layout, before launch, by
        ``models.transformer_config.build_transformer_config``.

        Raises:
            ValueError: ``model.<field>=<value> must be ...``.
        """
        self._check_ranges()
        self._check_yarn()
        self._check_routing_and_mla()
        self._check_layer_lists()
        self._check_experts()
        self._check_choices()
        self._check_recompute()

    def _check_ranges(self) -> None:
        """Sizes, counts, factors and scales in range."""
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "pad_attention_heads_multiple",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "max_position_embeddings",
        ):
            check_range("model", self, name, 1)
        for name in (
            "num_query_groups",
            "kv_channels",
            "recompute_num_layers",
            "num_experts",
            "moe_ffn_hidden_size",
        ):
            check_range("model", self, name, 1, optional=True)
        for name in ("rope_scaling_factor", "rope_linear_scaling_factor"):
            check_range("model", self, name, 0, low_open=True, optional=True)
        check_range("model", self, "rotary_base", 0, low_open=True)
        check_range("model", self, "rotary_percent", 0, 1, low_open=True)
        check_range("model", self, "norm_epsilon", 0, low_open=True)
        check_range("model", self, "init_method_std", 0, low_open=True)
        check_range("model", self, "moe_router_topk", 1)
        check_range(
            "model",
            self,
            "moe_aux_loss_coeff",
            0,
            optional=True,
            why="weight of the routers' load-balancing loss (null: the HF config's)",
        )
        check_range("model", self, "sliding_window", 1, optional=True)
        for name in (
            "moe_shared_expert_ffn_hidden_size",
            "moe_router_num_groups",
            "moe_router_group_topk",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            check_range("model", self, name, 1, optional=True)
        check_range("model", self, "moe_first_dense_layers", 0)
        check_range("model", self, "rope_yarn_factor", 0, low_open=True, optional=True)
        check_range("model", self, "rope_yarn_original_max_position_embeddings", 1)
        for name in ("rope_yarn_beta_fast", "rope_yarn_beta_slow"):
            check_range("model", self, name, 0, low_open=True)
        for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
            check_range("model", self, name, 0)
        check_range("model", self, "swiglu_limit", 0, low_open=True)

    def _check_yarn(self) -> None:
        """YaRN rotates every head dimension with one table: no other RoPE scaling beside it."""
        if self.rope_yarn_factor is not None:
            other = [
                name
                for name in (
                    "rope_scaling_factor",
                    "rope_linear_scaling_factor",
                    "local_rotary_base",
                )
                if getattr(self, name) is not None
            ] + (["rotary_percent"] if self.rotary_percent != 1.0 else [])
            if other or self.position_embedding_type != "rope":
                raise ValueError(
                    f"model.rope_yarn_factor={self.rope_yarn_factor} (YaRN) rotates every head "
                    f"dimension with one table: drop "
                    f"{', '.join('model.' + o for o in other) or 'model.position_embedding_type'}"
                )

    def _check_routing_and_mla(self) -> None:
        """The router's scaling and score function; the head sizes multi-latent attention needs."""
        check_range("model", self, "moe_routed_scaling_factor", 0, low_open=True, optional=True)
        check_choice("model", self, "moe_router_score_function", MOE_SCORE_FUNCTIONS)
        if self.kv_lora_rank is not None:
            missing = [
                name
                for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(
                    f"model.kv_lora_rank={self.kv_lora_rank} (multi-latent attention) needs "
                    f"{', '.join('model.' + m for m in missing)}"
                )

    def _check_layer_lists(self) -> None:
        """Per-layer lists (NoPE, windows) name layers that exist, and a window list has a size."""
        for name in ("no_rope_layers", "sliding_window_layers"):
            for index in getattr(self, name) or ():
                if not (isinstance(index, int) and 0 <= index < self.num_layers):
                    raise ValueError(
                        f"model.{name}: {index!r} is not a layer index in "
                        f"[0, {self.num_layers}) (model.num_layers={self.num_layers})"
                    )
        if self.sliding_window_layers is not None and self.sliding_window is None:
            raise ValueError(
                "model.sliding_window_layers is set but model.sliding_window is null: set the "
                "window size or drop the layer list"
            )

    def _check_experts(self) -> None:
        """The token dispatcher; grouped GEMM refused (no CPU kernel, no per-expert layer)."""
        check_choice("model", self, "moe_token_dispatcher", MOE_TOKEN_DISPATCHERS)
        if self.moe_grouped_gemm:
            raise ValueError(
                "model.moe_grouped_gemm=true is not supported: the engine builds megatron-core's "
                "SequentialMLP experts, whose per-expert linear_fc1 / linear_fc2 the checkpoint "
                "tables and LoRA adapters (lora.enabled) map; grouped GEMM needs the grouped_gemm "
                "package's CUDA kernels (GroupedMLP) or transformer-engine (TEGroupedMLP), "
                "neither runs on the CPU, and it fuses all experts into two weights beside which "
                "no per-expert adapter can sit; set model.moe_grouped_gemm=false (the same "
                "function)"
            )

    def _check_choices(self) -> None:
        """Named choices, and the local RoPE base only with windows."""
        check_choice("model", self, "position_embedding_type", POSITION_EMBEDDING_TYPES)
        check_choice("model", self, "normalization", NORMALIZATIONS)
        check_choice("model", self, "qk_norm_scope", QK_NORM_SCOPES)
        check_choice("model", self, "norm_placement", NORM_PLACEMENTS)
        for name in ("embedding_scale", "softmax_scale", "local_rotary_base"):
            check_range("model", self, name, 0, low_open=True, optional=True)
        if self.local_rotary_base is not None and self.sliding_window is None:
            raise ValueError(
                "model.local_rotary_base applies to sliding-window layers: set "
                "model.sliding_window too, or drop it"
            )
        check_choice("model", self, "transformer_impl", TRANSFORMER_IMPLS)
        check_choice("model", self, "head", HEADS)
        check_choice("model", self, "local_attention", LOCAL_ATTENTIONS)
        check_choice("model", self, "recompute_granularity", RECOMPUTE_GRANULARITIES, optional=True)
        check_choice("model", self, "recompute_method", RECOMPUTE_METHODS, optional=True)

    def _check_recompute(self) -> None:
        """Recompute modules are known and need selective recompute."""
        if self.recompute_modules is not None:
            for module in self.recompute_modules:
                if module not in RECOMPUTE_MODULES:
                    raise ValueError(
                        f"model.recompute_modules: {module!r} is not one of "
                        f"{', '.join(RECOMPUTE_MODULES)}"
                    )
            if self.recompute_granularity != "selective":
                raise ValueError(
                    f"model.recompute_modules={list(self.recompute_modules)} needs "
                    f"model.recompute_granularity=selective, got "
                    f"{self.recompute_granularity!r}"
                )


ARCHITECTURE_FIELDS = tuple(
    f.name for f in fields(ModelConfig) if f.name not in SOURCE_FIELDS + RUN_FIELDS + PADDING_FIELDS
)
"""What the model is: the fields an HF folder's config.json or a checkpoint's
``model_config.json`` gives (sizes, heads, norms, positions, experts, ...)."""


def architecture_differences(
    a: ModelConfig, b: ModelConfig, names: Iterable[str] | None = None
) -> dict[str, tuple[Any, Any]]:
    """The fields of :data:`ARCHITECTURE_FIELDS` in which ``a`` and ``b`` differ, name -> (a's
    value, b's value), and :data:`PADDING_FIELDS` that differ when the key/value groups they
    make differ. ``names``: compare only these fields (the keys a user set)."""
    wanted = set(ARCHITECTURE_FIELDS + PADDING_FIELDS if names is None else names)
    compared = [n for n in ARCHITECTURE_FIELDS if n in wanted]
    if a.stored_query_groups() != b.stored_query_groups():
        compared += [n for n in PADDING_FIELDS if n in wanted]
    return {
        n: (getattr(a, n), getattr(b, n))
        for n in compared
        if _plain(getattr(a, n)) != _plain(getattr(b, n))
    }


def _plain(value: Any) -> Any:
    """A value as JSON reads it back (a stored config's lists were tuples when saved)."""
    return list(value) if isinstance(value, tuple) else value


def with_run_settings(stored: ModelConfig, run: ModelConfig) -> ModelConfig:
    """A checkpoint's model (``stored``: architecture, padding, source and head) built as this
    run says: ``run``'s :data:`RUN_FIELDS` and ``load``. ``run.moe_aux_loss_coeff`` None means
    the checkpoint's, as with an HF folder's (``models.conversion.model_config_from_hf``)."""
    settings = {n: getattr(run, n) for n in RUN_FIELDS}
    if run.moe_aux_loss_coeff is None:
        settings.pop("moe_aux_loss_coeff")
    return replace(stored, load=run.load, **settings)
