"""Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), SmolLM2 (tied embeddings), Qwen3
(q/k norms), SmolLM3 (NoPE and sliding-window layers), and the MoE members Qwen3-MoE and Mixtral
(same attention, routed experts): one tensor table and one config translation."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    GATE_UP,
    HF_STACKED_DOWN,
    HF_STACKED_GATE_UP,
    LLAMA3_FIXED,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    TensorMap,
    decoder_dims,
    dims,
    hf_layer_types,
    llama_rope,
    sliding_window_fields,
)

logger = logging.getLogger(__name__)

LLAMA_IGNORED = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)
"""Buffers old Llama-family checkpoints may hold (rotary ``inv_freq``)."""


@dataclass(frozen=True)
class MoENames:
    """HF names of one MoE layer's router and expert MLPs (``{i}`` layer, ``{e}`` expert)."""

    router: str
    gate: str
    up: str
    down: str


QWEN3_MOE_NAMES = MoENames(
    router="model.layers.{i}.mlp.gate.weight",
    gate="model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    up="model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    down="model.layers.{i}.mlp.experts.{e}.down_proj.weight",
)
MIXTRAL_NAMES = MoENames(
    router="model.layers.{i}.block_sparse_moe.gate.weight",
    gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
)


def llama_tensors(cfg: ModelConfig, moe: MoENames | None = None) -> list[TensorMap]:
    p = "model.layers.{i}."
    d = "decoder.layers.{i}."
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
            d + "self_attention.linear_qkv.weight",
            (
                p + "self_attn.q_proj.weight",
                p + "self_attn.k_proj.weight",
                p + "self_attn.v_proj.weight",
            ),
            QKV,
            (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")),
        ),
        TensorMap(
            d + "self_attention.linear_proj.weight",
            (p + "self_attn.o_proj.weight",),
            ROW,
            (("hidden", "q"),),
        ),
        TensorMap(
            d + "pre_mlp_layernorm.weight",
            (p + "post_attention_layernorm.weight",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            "decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED, (("hidden",),)
        ),
    ]
    if moe is None:
        table += [
            TensorMap(
                d + "mlp.linear_fc1.weight",
                (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                GATE_UP,
                (("ffn", "hidden"), ("ffn", "hidden")),
            ),
            TensorMap(
                d + "mlp.linear_fc2.weight",
                (p + "mlp.down_proj.weight",),
                ROW,
                (("hidden", "ffn"),),
            ),
        ]
    else:
        e = d + "mlp.experts.local_experts.{e}."
        table += [
            # The router is replicated on every rank (TP and EP alike), in the model dtype
            # (megatron-core's TopKRouter computes its logits in fp32: moe_router_dtype).
            TensorMap(d + "mlp.router.weight", (moe.router,), REPLICATED, (("experts", "hidden"),)),
            TensorMap(
                e + "linear_fc1.weight",
                (moe.gate, moe.up),
                GATE_UP,
                (("expert_ffn", "hidden"), ("expert_ffn", "hidden")),
                hf_stacked=HF_STACKED_GATE_UP,
            ),
            TensorMap(
                e + "linear_fc2.weight",
                (moe.down,),
                ROW,
                (("hidden", "expert_ffn"),),
                hf_stacked=HF_STACKED_DOWN,
            ),
        ]
    if cfg.qk_layernorm:  # Qwen3: one RMSNorm weight over head_dim, shared by all heads
        table += [
            TensorMap(
                d + "self_attention.q_layernorm.weight",
                (p + "self_attn.q_norm.weight",),
                REPLICATED,
                (("head_dim",),),
            ),
            TensorMap(
                d + "self_attention.k_layernorm.weight",
                (p + "self_attn.k_norm.weight",),
                REPLICATED,
                (("head_dim",),),
            ),
        ]
    if cfg.add_qkv_bias:
        table.append(
            TensorMap(
                d + "self_attention.linear_qkv.bias",
                (
                    p + "self_attn.q_proj.bias",
                    p + "self_attn.k_proj.bias",
                    p + "self_attn.v_proj.bias",
                ),
                QKV,
                (("q",), ("kv",), ("kv",)),
            )
        )
    if not cfg.tie_word_embeddings:
        table.append(
            TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB, (("vocab", "hidden"),))
        )
    return table


def qwen3_moe_tensors(cfg: ModelConfig) -> list[TensorMap]:
    return llama_tensors(cfg, QWEN3_MOE_NAMES)


def mixtral_tensors(cfg: ModelConfig) -> list[TensorMap]:
    return llama_tensors(cfg, MIXTRAL_NAMES)


def _moe_config_from_hf(hf, name: str) -> dict:
    """MoE fields of a Qwen3-MoE or Mixtral config (empty for dense models).

    Raises:
        ValueError: dense layers interleaved with MoE layers (Qwen3-MoE ``decoder_sparse_step``
            / ``mlp_only_layers``), shared experts, or router jitter (DPO needs the reference
            and the policy to route alike: a random router is not supported).
    """
    if name == "qwen3_moe":
        if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", None):
            raise ValueError(
                f"{name}: decoder_sparse_step={hf.decoder_sparse_step} / "
                f"mlp_only_layers={hf.mlp_only_layers} (dense layers between MoE "
                "layers) is not supported: every layer must be an MoE layer"
            )
        if getattr(hf, "shared_expert_intermediate_size", 0):
            raise ValueError(f"{name}: shared experts are not supported")
        return dict(
            num_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_norm_topk_prob=bool(hf.norm_topk_prob),
            moe_aux_loss_coeff=float(hf.router_aux_loss_coef),
        )
    if name == "mixtral":
        if getattr(hf, "router_jitter_noise", 0.0):
            raise ValueError(
                f"{name}: router_jitter_noise={hf.router_jitter_noise} is not "
                "supported: DPO needs deterministic routing (the reference and the "
                "policy must route alike); set it to 0"
            )
        return dict(
            num_experts=hf.num_local_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size,
            moe_norm_topk_prob=True,
            moe_aux_loss_coeff=float(hf.router_aux_loss_coef),
        )
    return dict(num_experts=None, moe_ffn_hidden_size=None)


def _no_rope_layers(hf) -> list[int] | None:
    """SmolLM3's NoPE layers: the indices where HF's ``no_rope_layers`` holds 0 (HF: 1 = the
    layer applies RoPE; the config fills it from ``no_rope_layer_interval``, every 4th layer
    unrotated)."""
    flags = list(hf.no_rope_layers)
    if len(flags) != hf.num_hidden_layers:
        raise ValueError(
            f"smollm3: no_rope_layers has {len(flags)} entries for "
            f"num_hidden_layers={hf.num_hidden_layers}"
        )
    return [i for i, rotated in enumerate(flags) if not rotated] or None


def llama_config_from_hf(hf) -> dict:
    name = hf.model_type
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError(f"{name}: attention_bias / mlp_bias = true is not supported")
    theta, scaling_factor, linear_factor = llama_rope(hf, name)
    window = getattr(hf, "sliding_window", None)
    # Qwen2/3 configs carry a window that is off unless use_sliding_window is set.
    windowed = (
        getattr(hf, "use_sliding_window", False)
        if hasattr(hf, "use_sliding_window")
        else window is not None
    )
    sliding = {}
    if name == "smollm3":  # exact: the windowed layers of HF's layer_types
        sliding = sliding_window_fields(hf) if windowed else {}
    elif window is not None and windowed:
        logger.warning(
            "%s: sliding_window=%s is ignored (full causal attention); outputs differ "
            "from transformers only for sequences longer than the window",
            name,
            window,
        )
    return dict(
        no_rope_layers=_no_rope_layers(hf) if name == "smollm3" else None,
        qk_norm_scope="head",
        norm_placement="pre",
        norm_weight_offset=False,
        embedding_scale=None,
        softmax_scale=None,
        local_rotary_base=None,
        sliding_window=sliding.get("sliding_window"),
        sliding_window_layers=sliding.get("sliding_window_layers"),
        **decoder_dims(hf),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling_factor=scaling_factor,
        rope_linear_scaling_factor=linear_factor,
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=name == "qwen2",
        qk_layernorm=name in ("qwen3", "qwen3_moe"),
        parallel_residual=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        **_moe_config_from_hf(hf, name),
    )


def llama_config_to_hf(cfg: ModelConfig) -> dict:
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rotary_base,
            "factor": cfg.rope_scaling_factor,
            **LLAMA3_FIXED,
        }
    elif cfg.rope_linear_scaling_factor is not None:
        rope = {
            "rope_type": "linear",
            "rope_theta": cfg.rotary_base,
            "factor": cfg.rope_linear_scaling_factor,
        }
    out = dict(
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=dims(cfg)["head_dim"],
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope,
        rms_norm_eps=cfg.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.no_rope_layers:  # SmolLM3 (HF: 1 = RoPE applied)
        skipped = set(cfg.no_rope_layers)
        out["no_rope_layers"] = [int(i not in skipped) for i in range(cfg.num_layers)]
    if cfg.sliding_window is not None:  # SmolLM3
        out.update(
            use_sliding_window=True,
            sliding_window=cfg.sliding_window,
            layer_types=hf_layer_types(cfg),
        )
    if cfg.num_experts:
        out.update(
            num_experts_per_tok=cfg.moe_router_topk,
            router_aux_loss_coef=cfg.moe_aux_loss_coeff or 0.0,
        )
        if cfg.qk_layernorm:  # Qwen3-MoE
            out.update(
                num_experts=cfg.num_experts,
                norm_topk_prob=cfg.moe_norm_topk_prob,
                moe_intermediate_size=dims(cfg)["expert_ffn"],
            )
        else:  # Mixtral: experts are intermediate_size wide
            out.update(num_local_experts=cfg.num_experts, intermediate_size=dims(cfg)["expert_ffn"])
    return out
