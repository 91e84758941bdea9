"""megatron-core's ``TransformerConfig`` for a ModelConfig at a parallel layout, and the layout
rules it implies (heads / TP, layers / PP, vocabulary padding, dtype, layer implementation)."""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.parallel.device import backend, is_cuda, is_host


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, tanh approximation (Hendrycks & Gimpel 2016, sec. 2); HF's ``gelu_new``."""
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``: the gate activation of gpt-oss's clamped SwiGLU (transformers'
    ``GptOssExperts._apply_gate``, alpha 1.702). megatron-core's ``activations.quick_gelu`` is
    the same expression under ``torch.compile``, which on the CPU recompiles per token count
    (and in bf16 rounds differently with and without autograd, so a step-0 policy would not
    equal its reference bit for bit); this one runs eagerly."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "swiglu": F.silu,
    "geglu": gelu_tanh,
    "gelu": gelu_tanh,
    "gelu_exact": F.gelu,
    # gpt-oss: x * sigmoid(1.702 x) on the clamped gate, times (clamped up + 1) (glu_fields).
    "clamped_swiglu": quick_gelu,
}
"""``model.activation`` -> the elementwise function (SwiGLU, GeGLU and the clamped SwiGLU gate
it: ``gated_linear_unit``)."""
GATED = ("swiglu", "geglu", "clamped_swiglu")


def resolve_params_dtype(name: str) -> torch.dtype:
    """'auto' -> bf16 with CUDA, fp32 without; else the named dtype.

    Raises:
        ValueError: for names other than auto / float32 / bfloat16.
    """
    if name == "auto":
        return torch.bfloat16 if is_cuda() else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"model.params_dtype must be auto, float32 or bfloat16, got {name!r}")
    return dtypes[name]


def use_transformer_engine(impl: str) -> bool:
    """Whether to build with the transformer-engine layer spec (needs the engine's device to be
    a GPU: transformer-engine has no CPU kernels).

    Raises:
        ValueError: for 'transformer_engine' when it is not importable or the device is not CUDA.
    """
    available = is_cuda() and importlib.util.find_spec("transformer_engine")
    if impl == "transformer_engine":
        if not available:
            raise ValueError(
                "model.transformer_impl=transformer_engine needs CUDA and the "
                "transformer-engine package (pip install .[gpu])"
            )
        return True
    if impl not in ("auto", "local"):
        raise ValueError(
            f"model.transformer_impl must be auto, local or transformer_engine, got {impl!r}"
        )
    return impl == "auto" and bool(available)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Round the vocabulary up so each TP rank holds an equal, granule-aligned slice.

    Example: 49,152 with divisible_by 1 and TP 2 stays 49,152; 50,257 at TP 2 becomes 50,258.
    """
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def attention_heads(model: ModelConfig, tensor_model_parallel_size: int) -> tuple[int, int, int]:
    """(query heads, key/value groups, head dim) of the megatron model at this TP size.

    With ``model.pad_attention_heads`` the groups are rounded up to a multiple of
    ``model.pad_attention_heads_multiple`` (independent of TP, so checkpoints reshard), each extra
    group carrying the usual number of query heads with all-zero weights; e.g. 9 heads / 3 groups
    -> 12 heads / 4 groups, head dim unchanged (64).

    Raises:
        ValueError: heads not divisible by groups, or TP not dividing the (padded) groups.
    """
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    head_dim = model.kv_channels or model.hidden_size // heads
    if heads % groups:
        raise ValueError(
            f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}"
        )
    tp = tensor_model_parallel_size
    if model.pad_attention_heads:
        multiple = model.pad_attention_heads_multiple
        padded = model.stored_query_groups()
        heads, groups = padded * (heads // groups), padded
        if groups % tp:
            raise ValueError(
                f"model has {groups} key/value groups after padding to a multiple of "
                f"model.pad_attention_heads_multiple={multiple}, not divisible by "
                f"parallel.tensor_model_parallel_size={tp}: set the multiple to a multiple of {tp}"
            )
    elif groups % tp or heads % tp:
        raise ValueError(
            f"model has {heads} attention heads and {groups} key/value heads; both must be "
            f"divisible by parallel.tensor_model_parallel_size={tp} (or set "
            f"model.pad_attention_heads=true to add zero heads)"
        )
    return heads, groups, head_dim


def no_rope_pattern(model: ModelConfig) -> list[int] | None:
    """megatron-core's ``no_rope_freq`` list for ``model.no_rope_layers``: one entry per layer, 1
    where the layer applies no RoPE (e.g. layers [3] of 4 -> [0, 0, 0, 1]); None without NoPE
    layers."""
    if not model.no_rope_layers:
        return None
    skipped = set(model.no_rope_layers)
    return [int(i in skipped) for i in range(model.num_layers)]


def window_pattern(model: ModelConfig) -> list[int] | None:
    """megatron-core's ``window_attn_skip_freq`` list for ``model.sliding_window_layers``: one
    entry per layer, 1 where the layer is windowed (e.g. layers [0, 1, 2] of 4 -> [1, 1, 1, 0]);
    None when every layer is (or no layer has a window)."""
    if model.sliding_window is None or model.sliding_window_layers is None:
        return None
    windowed = set(model.sliding_window_layers)
    return [int(i in windowed) for i in range(model.num_layers)]


def yarn_attention_factor(model: ModelConfig) -> float:
    """YaRN's cos / sin scale m (Peng et al. 2023, eq. 21; transformers' ``yarn_get_mscale``
    ratio, megatron-core's concentration factor): ``g(mscale) / g(mscale_all_dim)`` with
    ``g(k) = 0.1 k ln(factor) + 1`` (1 for factor <= 1); 1 without YaRN. gpt-oss (factor 32, no
    mscale keys): 0.1 ln 32 + 1 = 1.3466."""
    factor = model.rope_yarn_factor
    if factor is None or factor <= 1:
        return 1.0

    def g(k: float) -> float:
        return 0.1 * k * math.log(factor) + 1.0

    return g(model.rope_yarn_mscale) / g(model.rope_yarn_mscale_all_dim)


def check_attention_sinks(model: ModelConfig, parallel: ParallelConfig, heads: int) -> None:
    """Refuse, at config time, an attention path that cannot serve ``model.attention_sinks``.

    Served: the local ``sdpa`` kernel (``models.attention.sdpa``: the sink as one more key) and
    the ``megatron`` kernel (megatron-core's learnable softmax offset). Refused: ``flex`` (its
    block mask has no sink column), transformer-engine, context parallelism (the local CP
    kernel merges per-block softmaxes without one), multi-latent attention and the zero heads of
    ``model.pad_attention_heads`` (their sinks would have no HF counterpart).

    Raises:
        ValueError: naming the field to change.
    """
    if not model.attention_sinks:
        return
    from dpo_megatron.models.attention import resolve_local_attention

    where = "model.attention_sinks=true"
    kernel = resolve_local_attention(model.local_attention)
    refused = {
        f"model.local_attention={model.local_attention} ({kernel}): set it to sdpa": kernel
        == "flex",
        "parallel.context_parallel_size>1: set it to 1": parallel.context_parallel_size > 1,
        "model.transformer_impl=transformer_engine: set it to local": model.transformer_impl
        == "transformer_engine",
        "model.kv_lora_rank (multi-latent attention): drop it": model.kv_lora_rank is not None,
        f"model.pad_attention_heads ({model.num_attention_heads} -> {heads} heads): use a TP "
        "size that divides the key/value heads": heads != model.num_attention_heads,
    }
    for name, on in refused.items():
        if on:
            raise ValueError(f"{where} is not served with {name}")


def check_sliding_window(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse, at config time, an attention path that cannot serve ``model.sliding_window``.

    The local ``sdpa`` kernel serves it (padded rows, packed rows and shared prompts; the CUDA
    varlen route too). Refused: the ``flex`` and ``megatron`` kernels (their masks have no
    window), transformer-engine (its window with shared-prompt THD rows is untested here) and
    context parallelism (the blockwise CP kernel has no window).

    Raises:
        ValueError: naming the field to change.
    """
    if model.sliding_window is None:
        return
    from dpo_megatron.models.attention import resolve_local_attention

    where = f"model.sliding_window={model.sliding_window}"
    if parallel.context_parallel_size > 1:
        raise ValueError(
            f"{where}: the context-parallel attention kernel has no sliding window; set "
            f"parallel.context_parallel_size=1"
        )
    if model.transformer_impl == "transformer_engine":
        raise ValueError(
            f"{where}: sliding windows run on the local layer spec only; set "
            f"model.transformer_impl=local (or auto)"
        )
    kernel = resolve_local_attention(model.local_attention)
    if kernel != "sdpa":
        raise ValueError(
            f"{where}: model.local_attention={model.local_attention} ({kernel}) has no "
            f"sliding window; set model.local_attention=sdpa"
        )


def check_model_layout(model: ModelConfig, parallel: ParallelConfig, heads: int) -> None:
    """The model's own fields and their fit with the layout (beyond heads / TP and MoE).

    Raises:
        ValueError: layers not divisible by PP x virtual stages, an unknown activation, a rotary
            percent outside (0, 1], MoE under context parallelism, NoPE layers without RoPE, a
            sliding window the layout cannot run, a projection q/k norm over padded heads, or
            post / sandwich norms with MoE or a parallel residual.
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    if model.num_layers % (pp * vpp):
        raise ValueError(
            f"model has {model.num_layers} layers, not divisible by "
            f"parallel.pipeline_model_parallel_size={pp} x virtual stages {vpp}"
        )
    if model.activation not in ACTIVATIONS:
        raise ValueError(
            f"model.activation must be one of {sorted(ACTIVATIONS)}, got {model.activation!r}"
        )
    if not 0.0 < model.rotary_percent <= 1.0:
        raise ValueError(f"model.rotary_percent={model.rotary_percent} must be in (0, 1]")
    if model.num_experts and parallel.context_parallel_size > 1:
        # The context-parallel split (data.context_split) does not cut the routers' padding mask.
        raise ValueError(
            f"model.num_experts={model.num_experts} with parallel."
            f"context_parallel_size={parallel.context_parallel_size}: mixture-of-"
            f"experts models do not run under context parallelism yet; set "
            f"parallel.context_parallel_size=1 (expert parallelism still applies)"
        )
    if model.no_rope_layers and model.position_embedding_type != "rope":
        raise ValueError(
            f"model.no_rope_layers={list(model.no_rope_layers)} needs "
            f"model.position_embedding_type=rope, got {model.position_embedding_type!r}"
        )
    check_sliding_window(model, parallel)
    check_attention_sinks(model, parallel, heads)
    projection_norm = model.qk_layernorm and model.qk_norm_scope == "projection"
    if projection_norm and heads != model.num_attention_heads:
        raise ValueError(
            f"model.qk_norm_scope=projection normalises over all heads: the zero heads that "
            f"model.pad_attention_heads adds at TP {tp} ({model.num_attention_heads} -> "
            f"{heads}) would change its mean; use a TP size that divides the key/value heads"
        )
    if model.norm_placement != "pre" and (model.num_experts or model.parallel_residual):
        raise ValueError(
            f"model.norm_placement={model.norm_placement} is wired for dense sequential layers "
            "only (not with "
            "model.num_experts or model.parallel_residual)"
        )


def moe_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """megatron-core's MoE fields (dropless top-k routing, this engine's load-balancing
    weighting) and the expert layout; empty for a dense model.

    Raises:
        ValueError: MoE fields that do not fit the layout (``models.moe.check_moe``).
    """
    from dpo_megatron.models.moe import check_moe, megatron_aux_loss_coeff

    etp = parallel.expert_tensor_parallel()
    expert_width = check_moe(
        model,
        parallel.expert_model_parallel_size,
        etp,
        parallel.tensor_model_parallel_size,
        parallel.sequence_parallel,
    )
    if expert_width is None:
        return {}
    aux = megatron_aux_loss_coeff(model)
    dense = model.moe_first_dense_layers
    return dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=expert_width,
        moe_router_topk=model.moe_router_topk,
        # Renormalised top-k = softmax over the k selected logits (no pre-softmax); the
        # top-k of the softmax over all experts otherwise. (Sigmoid scores ignore it.)
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_expert_bias,
        # The bias is a loaded weight, never updated: the policy must route as the reference.
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_routed_scaling_factor,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_ffn_hidden_size,
        moe_layer_freq=[0] * dense + [1] * (model.num_layers - dense) if dense else 1,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_grouped_gemm=False,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=etp,
    )


def attention_fields(model: ModelConfig, heads: int, groups: int, head_dim: int) -> dict:
    """Heads (padded for TP), biases, q/k norms, softmax scale and sinks of the attention.

    With YaRN on standard attention (gpt-oss) transformers scales RoPE's cos and sin by m
    (:func:`yarn_attention_factor`), which scales every query and key by m: here the scores are
    scaled by m ** 2 instead (the layers rotate by the unscaled YaRN table,
    ``models.gpt.ScoringGPTModel``). Multi-latent attention scales itself (:func:`mla_fields`)."""
    scale = model.softmax_scale
    if model.rope_yarn_factor is not None and model.kv_lora_rank is None:
        scale = (scale or head_dim**-0.5) * yarn_attention_factor(model) ** 2
    return dict(
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        add_qkv_bias=model.add_qkv_bias or model.add_bias_linear,
        # megatron-core all-reduces the q/k norms' gradients over TP when this is set (their
        # weights are replicated per head); a projection norm's weight is a TP shard instead.
        qk_layernorm=model.qk_layernorm and model.qk_norm_scope == "head",
        softmax_scale=scale,
        softmax_type="learnable" if model.attention_sinks else "vanilla",
    )


def position_fields(model: ModelConfig) -> dict:
    """Which layers apply no RoPE and which attend through a sliding window."""
    return dict(
        # megatron-core's Attention drops the rotary table in these layers (1 = no RoPE), before
        # any core attention runs, so every attention path serves NoPE layers alike.
        no_rope_freq=no_rope_pattern(model),
        # HF's window W (the query and W - 1 earlier keys) is megatron-core's (W - 1, 0); the
        # core attention reads it per layer (``is_layer_window_attention``).
        window_size=None if model.sliding_window is None else (model.sliding_window - 1, 0),
        window_attn_skip_freq=window_pattern(model),
    )


def kernel_fields(model: ModelConfig) -> dict:
    """Dropout (always 0), the fused kernels (only megatron-core's SwiGLU fusion) and the clamped
    SwiGLU's offset and clamp (megatron-core's unfused GLU: ``act(min(gate, l)) *
    (clamp(up, -l, l) + 1)``)."""
    clamped = model.activation == "clamped_swiglu"
    return dict(
        glu_linear_offset=1.0 if clamped else 0.0,
        activation_func_clamp_value=model.swiglu_limit if clamped else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        # megatron-core's SwiGLU autograd function keeps only its input for backward (the
        # unfused GLU also keeps the SiLU output, a copy of the linear half and the product);
        # same forward values. Eager on the CPU: dpo_megatron.compat.eager_fusions.
        bias_activation_fusion=model.activation == "swiglu",
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def layout_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """Dtypes, the parallel layout, where weights are initialised and how p2p is posted."""
    dtype = resolve_params_dtype(model.params_dtype)
    return dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context_parallel_size,
        # On a device other than the host (a GPU, the tests' strict:0) initialise there, as a GPU
        # run does; on the CPU device megatron-core's CPU path.
        use_cpu_initialization=is_host(),
        # gloo matches point-to-point messages between two ranks in posting order. Batched p2p
        # posts [send_prev, recv_prev, send_next, recv_next] on every rank, so with interleaved
        # (virtual) pipelining at PP 2, where the previous and the next rank are the same peer, an
        # activation lands in a gradient buffer of the same shape: silently wrong numbers. The
        # unbatched path orders sends and receives by rank parity, which pairs them correctly.
        # The condition is the backend, not the device: NCCL batches, gloo does not.
        batch_p2p_comm=backend() == "nccl",
    )


def recompute_fields(model: ModelConfig) -> dict:
    """Activation recomputation (megatron-core's own defaults where a field is unset)."""
    return dict(
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        **(
            {}
            if model.recompute_modules is None
            else {"recompute_modules": list(model.recompute_modules)}
        ),
    )


def mla_fields(model: ModelConfig) -> dict:
    """megatron-core's multi-latent attention fields (``MLATransformerConfig``); empty without
    MLA. Plain or YaRN RoPE over the ``qk_rope_head_dim`` dimensions (megatron-core
    de-interleaves them as DeepSeek's ``rope_interleave`` does); the softmax scale is
    ``m ** 2 / sqrt(nope + rope dims)``, m YaRN's ``mscale_all_dim`` factor (1 without YaRN)."""
    if model.kv_lora_rank is None:
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type="rope" if model.rope_yarn_factor is None else "yarn",
        rotary_base=model.rotary_base,
        rotary_percent=1.0,
        # Without YaRN the attention scale is 1 (megatron-core's _yarn_get_mscale of factor 1).
        rotary_scaling_factor=model.rope_yarn_factor or 1.0,
        original_max_position_embeddings=model.rope_yarn_original_max_position_embeddings,
        beta_fast=model.rope_yarn_beta_fast,
        beta_slow=model.rope_yarn_beta_slow,
        mscale=model.rope_yarn_mscale,
        mscale_all_dim=model.rope_yarn_mscale_all_dim,
    )


def check_mla(model: ModelConfig, parallel: ParallelConfig, heads: int) -> None:
    """Refuse, at config time, what multi-latent attention does not serve here.

    Raises:
        ValueError: zero heads added by ``model.pad_attention_heads`` (MLA has no key/value
            groups to pad), latent widths the TP size does not divide (megatron-core splits the
            down projections' outputs over TP), transformer-engine, context parallelism, a
            sliding window, NoPE layers, query/key norms, RoPE scaling or the ``megatron`` core
            attention kernel (naming the field).
    """
    if model.kv_lora_rank is None:
        return
    tp = parallel.tensor_model_parallel_size
    where = f"model.kv_lora_rank={model.kv_lora_rank} (multi-latent attention)"
    if heads != model.num_attention_heads or model.num_attention_heads % tp:
        raise ValueError(
            f"{where}: {model.num_attention_heads} attention heads must be divisible by "
            f"parallel.tensor_model_parallel_size={tp} (MLA heads are not padded)"
        )
    widths = {
        "model.kv_lora_rank + model.qk_rope_head_dim": model.kv_lora_rank + model.qk_rope_head_dim,
        "model.q_lora_rank": model.q_lora_rank or 0,
    }
    for name, width in widths.items():
        if width % tp:
            raise ValueError(
                f"{where}: {name}={width} is not divisible by "
                f"parallel.tensor_model_parallel_size={tp} (megatron-core splits the latent "
                "down-projection over TP)"
            )
    from dpo_megatron.models.attention import resolve_local_attention

    refused = {
        "model.local_attention=megatron (its unfused kernel has one head size)": (
            resolve_local_attention(model.local_attention) == "megatron"
        ),
        "parallel.context_parallel_size>1": parallel.context_parallel_size > 1,
        "model.transformer_impl=transformer_engine": model.transformer_impl == "transformer_engine",
        "model.sliding_window": model.sliding_window is not None,
        "model.no_rope_layers": bool(model.no_rope_layers),
        "model.qk_layernorm": model.qk_layernorm,
        "model.rope_scaling_factor / model.rope_linear_scaling_factor": (
            model.rope_scaling_factor is not None or model.rope_linear_scaling_factor is not None
        ),
        "model.local_rotary_base": model.local_rotary_base is not None,
        "model.position_embedding_type!=rope": model.position_embedding_type != "rope",
    }
    for name, on in refused.items():
        if on:
            raise ValueError(
                f"{where} is not wired with {name} (MLA runs on the local spec with plain RoPE "
                "and the local core attention); drop it"
            )


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig for this architecture and layout.

    Dropout is always 0: DPO's log-ratios must be computed by the same deterministic function for
    policy and reference (and the pipeline compares chosen with rejected).

    Mixture-of-experts models get megatron-core's MoE fields (dropless top-k routing, this
    engine's load-balancing weighting: ``dpo_megatron.models.moe``) and the expert layout.

    Raises:
        ValueError: heads or query groups not divisible by TP, layers not divisible by PP, an
            unknown activation, MoE fields that do not fit the layout (``models.moe``), or MoE
            under context parallelism.
    """
    heads, groups, head_dim = attention_heads(model, parallel.tensor_model_parallel_size)
    check_model_layout(model, parallel, heads)
    check_mla(model, parallel, heads)
    moe = moe_fields(model, parallel)
    mla = mla_fields(model)
    config_class = MLATransformerConfig if mla else TransformerConfig
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.activation in GATED,
        activation_func=ACTIVATIONS[model.activation],
        add_bias_linear=model.add_bias_linear,
        init_method_std=model.init_method_std,
        # Loss is normalised by the global number of pairs: see dpo_megatron.training.step.
        calculate_per_token_loss=True,
        **attention_fields(model, heads, groups, head_dim),
        **position_fields(model),
        **kernel_fields(model),
        **layout_fields(model, parallel),
        **recompute_fields(model),
        **moe,
        **mla,
    )
