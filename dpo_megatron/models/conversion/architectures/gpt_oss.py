"""gpt-oss (``GptOssForCausalLM``): grouped-query attention with q/k/v/o biases and one learnable
sink logit per head, sliding windows in the ``sliding_attention`` layers of ``layer_types``, YaRN
RoPE, and an MoE in every layer: a router with a bias (top-k of the logits, softmax over the k),
experts with biases and a clamped SwiGLU (``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)``,
``g = min(gate, l)``).

The checkpoint stores each layer's experts stacked, in HF's ``[in, out]`` orientation, gate and
up interleaved along the output (``gate_up_proj[e, :, 0::2]`` is expert e's gate):
``mlp.experts.gate_up_proj`` [E, hidden, 2F], ``gate_up_proj_bias`` [E, 2F], ``down_proj``
[E, F, hidden], ``down_proj_bias`` [E, hidden]. The table names one expert's tensors like the other
MoE families (``mlp.experts.{e}.gate_proj.weight`` [F, hidden], ...) and :data:`STACKED_EXPERTS`
translates: the loader reads an expert's slice of the stacked tensor (:class:`StackedExpertsView`),
the exporter stacks and interleaves them again (:func:`pack_stacked_experts`); both only index,
transpose and concatenate, so an export is bit for bit the imported folder. transformers holds
the same stacked parameters in memory, where PEFT adapts them (``target_parameters``): the
expert weights' ``hf_stacked`` names them, ``hf_interleaved`` has the adapter export put the
rows of an expert's B in the interleaved order.

megatron-core names: ``self_attention.core_attention.softmax_offset`` (the sinks, split with the
heads), ``mlp.router.weight`` / ``bias`` (replicated), ``mlp.experts.local_experts.{e}.linear_fc1``
([gate_r; up_r] per expert-TP rank, weight and bias) and ``linear_fc2``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures.base import (
    COLUMN,
    GATE_UP,
    HF_STACKED_DOWN,
    HF_STACKED_GATE_UP,
    REPLICATED,
    ROW,
    TensorMap,
    decoder_dims,
    dims,
    hf_layer_types,
    interleave_rows,
    rope_parameters,
    sliding_window_fields,
    yarn_fields,
    yarn_rope_to_hf,
)
from dpo_megatron.models.conversion.architectures.llama import llama_tensors

SWIGLU_ALPHA = 1.702
"""The sigmoid gain of gpt-oss's clamped SwiGLU, megatron-core's ``quick_gelu`` constant."""


def gpt_oss_tensors(cfg: ModelConfig) -> list[TensorMap]:
    """The gpt-oss table for ``cfg``: the Llama attention and norms with q/k/v and o biases, the
    sinks, the biased router and one expert's tensors under the per-expert names of
    :data:`STACKED_EXPERTS` (the output layer only when untied)."""
    p, d = "model.layers.{i}.", "decoder.layers.{i}."
    e, x = d + "mlp.experts.local_experts.{e}.", p + "mlp.experts.{e}."
    # The Llama attention with its q/k/v biases (every linear has one here); no dense MLP.
    table = llama_tensors(dataclasses.replace(cfg, add_qkv_bias=True))
    table = [t for t in table if ".mlp.linear_fc" not in t.megatron]
    return table + [
        TensorMap(
            d + "self_attention.linear_proj.bias",
            (p + "self_attn.o_proj.bias",),
            REPLICATED,
            (("hidden",),),
        ),
        TensorMap(
            d + "self_attention.core_attention.softmax_offset",
            (p + "self_attn.sinks",),
            COLUMN,
            (("heads",),),
        ),
        TensorMap(
            d + "mlp.router.weight",
            (p + "mlp.router.weight",),
            REPLICATED,
            (("experts", "hidden"),),
        ),
        TensorMap(d + "mlp.router.bias", (p + "mlp.router.bias",), REPLICATED, (("experts",),)),
        TensorMap(
            e + "linear_fc1.weight",
            (x + "gate_proj.weight", x + "up_proj.weight"),
            GATE_UP,
            (("expert_ffn", "hidden"), ("expert_ffn", "hidden")),
            hf_stacked=HF_STACKED_GATE_UP,
            hf_interleaved=True,
        ),
        TensorMap(
            e + "linear_fc1.bias",
            (x + "gate_proj.bias", x + "up_proj.bias"),
            GATE_UP,
            (("expert_ffn",), ("expert_ffn",)),
        ),
        TensorMap(
            e + "linear_fc2.weight",
            (x + "down_proj.weight",),
            ROW,
            (("hidden", "expert_ffn"),),
            hf_stacked=HF_STACKED_DOWN,
        ),
        TensorMap(e + "linear_fc2.bias", (x + "down_proj.bias",), REPLICATED, (("hidden",),)),
    ]


# ---------------------------------------------------------------------------------------------
# The stacked expert tensors of the files <-> one expert's tensors of the table.
# ---------------------------------------------------------------------------------------------

_STORED = re.compile(
    r"^(?P<layer>.*\.mlp\.experts\.)(?P<kind>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)
"""A stored stacked tensor: ``<layer prefix>mlp.experts.(gate_up_proj|down_proj)[_bias]``."""
_PER_EXPERT = re.compile(
    r"^(?P<layer>.*\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<what>weight|bias)$"
)
"""A table name of one expert: ``<layer prefix>mlp.experts.<e>.<proj>.(weight|bias)``."""
_PARTS = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}
"""Each stored kind's per-expert projections and their interleave offset (None: the whole)."""


class StackedExpertsView:
    """A checkpoint reader (``hf_files.HFCheckpointReader``'s ``names`` / ``shape`` / ``read`` /
    ``close``) that presents each stacked expert tensor as one tensor per expert and projection,
    in megatron orientation: ``...experts.<e>.gate_proj.weight`` [F, hidden] (and ``up_proj``),
    ``...gate_proj.bias`` [F], ``...down_proj.weight`` [hidden, F], ``...down_proj.bias``
    [hidden]. A read takes expert e's slice of the stored tensor only. Other names pass
    through."""

    def __init__(self, reader):
        self.inner = reader
        self.hf_path = reader.hf_path
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._source: dict[str, tuple[str, int, int | None]] = {}
        for name in reader.names():
            m = _STORED.match(name)
            if m is None:
                self._shapes[name] = reader.shape(name)
                continue
            shape = reader.shape(name)
            what = "bias" if m["bias"] else "weight"
            for expert in range(shape[0]):
                for proj, offset in _PARTS[m["kind"]]:
                    one = list(shape[1:])
                    if offset is not None:
                        one[-1] //= 2
                    view = f"{m['layer']}{expert}.{proj}.{what}"
                    self._shapes[view] = tuple(one[::-1])  # [in, out] -> [out, in]
                    self._source[view] = (name, expert, offset)

    def names(self) -> list[str]:
        """Every presented tensor name."""
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        """Presented shape (megatron orientation for an expert's tensor)."""
        return self._shapes[name]

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Rows ``[start, stop)`` along ``dim`` of a presented tensor (contiguous, CPU)."""
        if name not in self._source:
            return self.inner.read(name, dim, start, stop)
        stored, expert, offset = self._source[name]
        tensor = self.inner.read(stored, 0, expert, expert + 1)[0]
        if offset is not None:
            tensor = tensor[..., offset::2]
        if tensor.dim() == 2:
            tensor = tensor.t()
        stop = tensor.shape[dim] if stop is None else stop
        return tensor.narrow(dim, start, stop - start).contiguous()

    def close(self) -> None:
        """Release the files."""
        self.inner.close()


def pack_stacked_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of :class:`StackedExpertsView` on an export's ``(name, tensor)`` stream: every
    expert's tensors of a layer are held until the layer's ``cfg.num_experts`` experts are in,
    then written as the stored stacked, interleaved, ``[in, out]`` tensors. Other tensors pass
    through in order.

    Raises:
        ValueError: the stream ended with a layer's experts incomplete (names it).
    """
    pending: dict[tuple[str, str, str], dict[tuple[int, str], torch.Tensor]] = {}
    experts = cfg.num_experts or 0
    for name, tensor in tensors:
        m = _PER_EXPERT.match(name)
        if m is None:
            yield name, tensor
            continue
        kind = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
        key = (m["layer"], kind, m["what"])
        parts = pending.setdefault(key, {})
        parts[(int(m["e"]), m["proj"])] = tensor
        if len(parts) < experts * len(_PARTS[kind]):
            continue
        del pending[key]
        stacked = []
        for expert in range(experts):
            # gate_up: interleaved along the output (gate_0, up_0, gate_1, ...)
            one = interleave_rows([parts[(expert, proj)] for proj, _ in _PARTS[kind]])
            stacked.append(one.t() if one.dim() == 2 else one)
        bias = "_bias" if m["what"] == "bias" else ""
        yield f"{m['layer']}{kind}{bias}", torch.stack(stacked).contiguous()
    if pending:
        raise ValueError(f"gpt_oss export: experts missing for {sorted(pending)[:3]}")


class StackedExperts:
    """gpt-oss's ``Architecture.file_layout``: :class:`StackedExpertsView` on load,
    :func:`pack_stacked_experts` on export."""

    @staticmethod
    def view(reader) -> StackedExpertsView:
        return StackedExpertsView(reader)

    @staticmethod
    def pack(tensors, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        return pack_stacked_experts(tensors, cfg)


STACKED_EXPERTS = StackedExperts()


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def gpt_oss_config_from_hf(hf) -> dict:
    """ModelConfig fields of a gpt-oss config.

    Raises:
        ValueError: naming what is not served: ``attention_bias=false``, a SwiGLU gain other
            than 1.702, a RoPE other than plain or YaRN (and YaRN settings ``base.yarn_fields``
            refuses, or ``mscale_all_dim`` without ``mscale``). A quantized checkpoint (the hub's
            MXFP4 experts) is refused before, by ``hf_config.model_config_from_hf``.
    """
    name = hf.model_type
    if not getattr(hf, "attention_bias", True):
        raise ValueError(f"{name}: attention_bias=false is not supported (gpt-oss has biases)")
    alpha = float(getattr(hf, "swiglu_alpha", SWIGLU_ALPHA))
    if alpha != SWIGLU_ALPHA:
        raise ValueError(
            f"{name}: swiglu_alpha={alpha} is not supported (megatron-core's quick-GELU gain "
            f"is {SWIGLU_ALPHA})"
        )
    rope = rope_parameters(hf)
    if rope["rope_type"] == "yarn":
        if rope.get("mscale_all_dim") and not rope.get("mscale"):
            raise ValueError(
                f"{name}: rope_parameters.mscale_all_dim without mscale is not supported "
                "(transformers then ignores mscale_all_dim)"
            )
        yarn = yarn_fields(rope, name)
    elif rope["rope_type"] == "default":
        yarn = {"rope_yarn_factor": None}
    else:
        raise ValueError(
            f"{name}: rope_type={rope['rope_type']!r} is not supported (supported: default, yarn)"
        )
    sliding = sliding_window_fields(hf)
    sizes = decoder_dims(hf)
    return dict(
        **sizes,
        **yarn,
        position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        rotary_percent=1.0,
        rope_scaling_factor=None,
        rope_linear_scaling_factor=None,
        local_rotary_base=None,
        no_rope_layers=None,
        sliding_window=sliding.get("sliding_window"),
        sliding_window_layers=sliding.get("sliding_window_layers"),
        normalization="RMSNorm",
        norm_epsilon=hf.rms_norm_eps,
        norm_weight_offset=False,
        embedding_scale=None,
        softmax_scale=None,
        attention_sinks=True,
        activation="clamped_swiglu",
        swiglu_limit=float(hf.swiglu_limit),
        add_bias_linear=True,
        add_qkv_bias=True,
        qk_layernorm=False,
        qk_norm_scope="head",
        norm_placement="pre",
        parallel_residual=False,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        num_experts=hf.num_local_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=sizes["ffn_hidden_size"],
        # Top-k of the logits, softmax over the k (= renormalised top-k of the full softmax).
        moe_norm_topk_prob=True,
        moe_aux_loss_coeff=float(hf.router_aux_loss_coef),
    )


def gpt_oss_config_to_hf(cfg: ModelConfig) -> dict:
    """gpt-oss config.json fields of ``cfg`` (an export without a source folder)."""
    return dict(
        num_hidden_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=dims(cfg)["expert_ffn"],
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=dims(cfg)["head_dim"],
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=yarn_rope_to_hf(cfg),
        rms_norm_eps=cfg.norm_epsilon,
        sliding_window=cfg.sliding_window,
        layer_types=hf_layer_types(cfg) or ["full_attention"] * cfg.num_layers,
        attention_bias=True,
        swiglu_limit=cfg.swiglu_limit,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff or 0.0,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
