"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention (low-rank query and key/value
latents with their RMSNorms, a RoPE part of each head whose key is shared by the heads), and an
MoE whose first ``first_k_dense_replace`` layers are dense, with a shared expert, sigmoid router
scores, a fixed expert score bias, group-limited top-k and a routed scaling factor.

megatron-core names (``MLASelfAttention`` of the local spec): ``linear_q_down_proj`` /
``q_layernorm`` / ``linear_q_up_proj`` (HF ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``; one
``linear_q_proj`` = HF ``q_proj`` without a query latent), ``linear_kv_down_proj`` (HF
``kv_a_proj_with_mqa``: [latent; shared rope key]), ``kv_layernorm``, ``linear_kv_up_proj`` (HF
``kv_b_proj``: per head [key nope; value]), ``linear_proj`` (HF ``o_proj``). The down
projections are column-parallel in megatron-core (their outputs are gathered over TP before
the norms), the up projections column-parallel by heads, ``linear_proj`` row-parallel.
"""

from __future__ import annotations

import dataclasses

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    COLUMN,
    GATE_UP,
    HF_STACKED_DOWN,
    HF_STACKED_GATE_UP,
    REPLICATED,
    ROW,
    VOCAB,
    TensorMap,
    decoder_dims,
    llama_rope,
    rope_parameters,
    yarn_fields,
    yarn_rope_to_hf,
)


def deepseek_v3_tensors(cfg: ModelConfig) -> list[TensorMap]:
    """The DeepSeek-V3 table for ``cfg``: embeddings, MLA projections and norms (the query
    latent's only with ``q_lora_rank``), the dense MLP of the first ``moe_first_dense_layers``
    layers, router / score bias / routed and shared experts of the others, final norm, and the
    output layer when untied."""
    p, d = "model.layers.{i}.", "decoder.layers.{i}."
    a, m = p + "self_attn.", d + "self_attention."
    dense = tuple(range(cfg.moe_first_dense_layers)) if cfg.num_experts else None
    sparse = tuple(range(cfg.moe_first_dense_layers, cfg.num_layers))
    table = [
        TensorMap(
            "embedding.word_embeddings.weight",
            ("model.embed_tokens.weight",),
            VOCAB,
            (("vocab", "hidden"),),
        ),
        TensorMap(
            d + "input_layernorm.weight",
            (p + "input_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "pre_mlp_layernorm.weight",
            (p + "post_attention_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            m + "linear_kv_down_proj.weight",
            (a + "kv_a_proj_with_mqa.weight",),
            COLUMN,
            (("mla_kv_a", "hidden"),),
        ),
        TensorMap(
            m + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",), REPLICATED, (("kv_lora",),)
        ),
        TensorMap(
            m + "linear_kv_up_proj.weight",
            (a + "kv_b_proj.weight",),
            COLUMN,
            (("mla_kv_b", "kv_lora"),),
        ),
        TensorMap(m + "linear_proj.weight", (a + "o_proj.weight",), ROW, (("hidden", "mla_o"),)),
        TensorMap(
            "decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED, (("hidden",),)
        ),
    ]
    if cfg.q_lora_rank is None:
        table.append(
            TensorMap(
                m + "linear_q_proj.weight", (a + "q_proj.weight",), COLUMN, (("mla_q", "hidden"),)
            )
        )
    else:
        table += [
            TensorMap(
                m + "linear_q_down_proj.weight",
                (a + "q_a_proj.weight",),
                COLUMN,
                (("q_lora", "hidden"),),
            ),
            TensorMap(
                m + "q_layernorm.weight", (a + "q_a_layernorm.weight",), REPLICATED, (("q_lora",),)
            ),
            TensorMap(
                m + "linear_q_up_proj.weight",
                (a + "q_b_proj.weight",),
                COLUMN,
                (("mla_q", "q_lora"),),
            ),
        ]
    mlp = [
        TensorMap(
            d + "mlp.linear_fc1.weight",
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            GATE_UP,
            (("ffn", "hidden"), ("ffn", "hidden")),
            layers=dense,
        ),
        TensorMap(
            d + "mlp.linear_fc2.weight",
            (p + "mlp.down_proj.weight",),
            ROW,
            (("hidden", "ffn"),),
            layers=dense,
        ),
    ]
    if not cfg.num_experts:
        return table + mlp + _output(cfg)
    e, s = d + "mlp.experts.local_experts.{e}.", p + "mlp.shared_experts."
    moe = [
        # Router weight and score bias replicated on every rank; megatron-core keeps the bias in
        # fp32 and computes the router's logits in fp32 (moe_router_dtype), as transformers does.
        TensorMap(
            d + "mlp.router.weight", (p + "mlp.gate.weight",), REPLICATED, (("experts", "hidden"),)
        ),
        TensorMap(
            e + "linear_fc1.weight",
            (p + "mlp.experts.{e}.gate_proj.weight", p + "mlp.experts.{e}.up_proj.weight"),
            GATE_UP,
            (("expert_ffn", "hidden"), ("expert_ffn", "hidden")),
            hf_stacked=HF_STACKED_GATE_UP,
        ),
        TensorMap(
            e + "linear_fc2.weight",
            (p + "mlp.experts.{e}.down_proj.weight",),
            ROW,
            (("hidden", "expert_ffn"),),
            hf_stacked=HF_STACKED_DOWN,
        ),
        TensorMap(
            d + "mlp.shared_experts.linear_fc1.weight",
            (s + "gate_proj.weight", s + "up_proj.weight"),
            GATE_UP,
            (("shared_ffn", "hidden"), ("shared_ffn", "hidden")),
        ),
        TensorMap(
            d + "mlp.shared_experts.linear_fc2.weight",
            (s + "down_proj.weight",),
            ROW,
            (("hidden", "shared_ffn"),),
        ),
    ]
    if cfg.moe_router_expert_bias:
        moe.append(
            TensorMap(
                d + "mlp.router.expert_bias",
                (p + "mlp.gate.e_score_correction_bias",),
                REPLICATED,
                (("experts",),),
            )
        )
    moe = [dataclasses.replace(t, layers=sparse) for t in moe]
    return table + (mlp if dense else []) + moe + _output(cfg)


def _output(cfg: ModelConfig) -> list[TensorMap]:
    if cfg.tie_word_embeddings:
        return []
    return [TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB, (("vocab", "hidden"),))]


def deepseek_v3_config_from_hf(hf) -> dict:
    """ModelConfig fields of a DeepSeek-V3 config.

    Raises:
        ValueError: naming what is not served: an activation other than SiLU, attention
            biases, ``rope_interleave=false``, a RoPE other than plain or YaRN (and YaRN
            settings megatron-core computes differently: ``base.yarn_fields``), or no routed
            experts. (Multi-token-prediction layers in a checkpoint are named as unmapped
            tensors by the loader.)
    """
    name = hf.model_type
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_bias", False):
        raise ValueError(f"{name}: attention_bias=true is not supported")
    if not getattr(hf, "rope_interleave", True):
        raise ValueError(
            f"{name}: rope_interleave=false is not supported: megatron-core's multi-latent "
            "attention rotates DeepSeek's interleaved pairs (rope_interleave=true)"
        )
    rope = rope_parameters(hf)
    theta = float(rope["rope_theta"])
    yarn = yarn_fields(rope, name) if rope["rope_type"] == "yarn" else {}
    if not yarn:
        theta, _, _ = llama_rope(hf, name)  # default; other types refused by name there
    n_experts = getattr(hf, "n_routed_experts", None)
    if not n_experts:
        raise ValueError(f"{name}: n_routed_experts={n_experts} is not supported (an MoE model)")
    groups = getattr(hf, "n_group", None) or 1
    group_topk = getattr(hf, "topk_group", None) or groups
    dims = decoder_dims(hf)
    heads = hf.num_attention_heads
    dims.update(num_query_groups=heads, kv_channels=hf.v_head_dim)
    return dict(
        **dims,
        **(yarn or {"rope_yarn_factor": None}),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling_factor=None,
        rope_linear_scaling_factor=None,
        local_rotary_base=None,
        no_rope_layers=None,
        sliding_window=None,
        sliding_window_layers=None,
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        norm_weight_offset=False,
        embedding_scale=None,
        softmax_scale=None,
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        qk_norm_scope="head",
        norm_placement="pre",
        parallel_residual=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        kv_lora_rank=hf.kv_lora_rank,
        q_lora_rank=hf.q_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        num_experts=n_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_norm_topk_prob=bool(hf.norm_topk_prob),
        # transformers computes no load-balancing loss for DeepSeek-V3.
        moe_aux_loss_coeff=0.0,
        moe_first_dense_layers=int(hf.first_k_dense_replace or 0),
        moe_shared_expert_ffn_hidden_size=(hf.n_shared_experts or 0) * hf.moe_intermediate_size
        or None,
        moe_router_score_function="sigmoid",
        moe_router_expert_bias=True,
        # One group, or every group chosen: no group limit (megatron-core's rule then differs
        # from DeepSeek's only in a ranking that selects everything).
        moe_router_num_groups=groups if group_topk < groups else None,
        moe_router_group_topk=group_topk if group_topk < groups else None,
        moe_routed_scaling_factor=float(hf.routed_scaling_factor),
    )


def deepseek_v3_config_to_hf(cfg: ModelConfig) -> dict:
    """DeepSeek-V3 config.json fields of ``cfg`` (an export without a source folder).

    Raises:
        ValueError: a shared-expert width that is not a whole number of experts.
    """
    expert_ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    shared = cfg.moe_shared_expert_ffn_hidden_size or 0
    if shared % expert_ffn:
        raise ValueError(
            f"model.moe_shared_expert_ffn_hidden_size={shared} is not a multiple of the expert "
            f"width {expert_ffn}: DeepSeek-V3 configs state it as n_shared_experts"
        )
    return dict(
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=expert_ffn,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=yarn_rope_to_hf(cfg),
        rope_interleave=True,
        rms_norm_eps=cfg.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_word_embeddings,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        norm_topk_prob=cfg.moe_norm_topk_prob,
        first_k_dense_replace=cfg.moe_first_dense_layers,
        n_shared_experts=shared // expert_ffn,
        n_group=cfg.moe_router_num_groups or 1,
        topk_group=cfg.moe_router_group_topk or 1,
        routed_scaling_factor=cfg.moe_routed_scaling_factor or 1.0,
    )
