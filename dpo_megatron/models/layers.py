"""Transformer layers megatron-core does not ship: GPT-NeoX's parallel residual and OLMo's
post-norm layer (:class:`PostNormTransformerLayer`).

megatron-core's ``TransformerLayer`` is sequential (``h = x + attn(ln1(x)); h + mlp(ln2(h))``).
GPT-NeoX (Black et al. 2022, sec. 2.1; Pythia) feeds the layer input to both branches::

    y = x + attn(ln1(x)) + mlp(ln2(x))

:class:`ParallelResidualTransformerLayer` is that layer: the same submodules (built from the same
layer spec, so weights, TP sharding and checkpoints are megatron-core's), another ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import make_viewless_tensor


class ParallelResidualTransformerLayer(TransformerLayer):
    """``TransformerLayer`` with GPT-NeoX's parallel residual (module docstring).

    Shapes: hidden_states [s(/TP under sequence parallelism), b, h] -> the same, and the
    (unused, None) cross-attention context, like the parent. Biases are added by the layer's
    bias-dropout-add modules (dropout is 0 in this engine). Selective recompute of the norms
    (``recompute_modules`` 'layernorm') is refused, as is 'mlp' (the parent's hooks for them sit
    in its sequential forward); full recompute works.

    Raises:
        ValueError: at construction, with ``model.recompute_modules`` 'layernorm' or 'mlp'.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm or self.recompute_mlp:
            raise ValueError(
                "model.recompute_modules: 'layernorm' and 'mlp' are not wired for "
                "GPT-NeoX's parallel residual (model.parallel_residual); use "
                "model.recompute_granularity=full"
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,
        **unused,
    ):
        attention = self.self_attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        mlp = self.mlp(self.pre_mlp_layernorm(hidden_states), padding_mask=padding_mask)
        fused = self.config.bias_dropout_fusion
        with torch.enable_grad():  # as the parent: bias-dropout-add keeps its graph
            output = self.self_attn_bda(self.training, fused)(
                attention, hidden_states, self.hidden_dropout
            )
            output = self.mlp_bda(self.training, fused)(mlp, output, self.hidden_dropout)
        output = make_viewless_tensor(
            inp=output, requires_grad=output.requires_grad, keep_graph=True
        )
        return output, context


class PostNormTransformerLayer(TransformerLayer):
    """OLMo 2 / 3's layer: the norms sit on the branch outputs, none on the inputs::

        h = x + norm_attn(attn(x));  y = h + norm_mlp(mlp(h))

    With the pre-norms kept (Gemma 2 / 3's "sandwich") it is
    ``h = x + norm_attn(attn(ln1(x))); y = h + norm_mlp(mlp(ln2(h)))``; OLMo's pre-norms are
    identities in the spec.

    (Groeneveld et al. 2025, OLMo 2, sec. 3.2: "reordered norm"). Built from the sequential layer
    spec with identity pre-norms; the two post-norms are this module's
    ``post_attention_layernorm`` and ``post_mlp_layernorm`` (class ``norm``, the model's
    normalisation, SP-aware). Dense MLPs only; full recompute works, selective 'layernorm' /
    'mlp' are refused as for :class:`ParallelResidualTransformerLayer`.

    Shapes: as the parent.

    Raises:
        ValueError: at construction, with ``model.recompute_modules`` 'layernorm' or 'mlp'.
    """

    def __init__(self, config, submodules, *args, norm=None, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        if self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm or self.recompute_mlp:
            raise ValueError(
                "model.recompute_modules: 'layernorm' and 'mlp' are not wired for post-norm "
                "layers (model.norm_placement=post); use model.recompute_granularity=full"
            )
        eps = config.layernorm_epsilon
        self.post_attention_layernorm = norm(config, config.hidden_size, eps=eps)
        self.post_mlp_layernorm = norm(config, config.hidden_size, eps=eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        padding_mask=None,
        **unused,
    ):
        attention, bias = self.self_attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if bias is not None:
            attention = attention + bias
        hidden = hidden_states + self.post_attention_layernorm(attention)
        mlp, bias = self.mlp(self.pre_mlp_layernorm(hidden), padding_mask=padding_mask)
        if bias is not None:
            mlp = mlp + bias
        output = hidden + self.post_mlp_layernorm(mlp)
        output = make_viewless_tensor(
            inp=output, requires_grad=output.requires_grad, keep_graph=True
        )
        return output, context


@dataclass
class LayerTypeRope:
    """Two RoPE tables for one forward: ``full`` for full-attention layers, ``local`` for the
    sliding-window layers (Gemma 3 rotates them with another theta and no scaling). Each is
    megatron-core's [L, R, 1, dim] table (``models.gpt.ScoringGPTModel``)."""

    full: torch.Tensor
    local: torch.Tensor


class LayerTypeRopeSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` that, given a :class:`LayerTypeRope`, rotates with the
    table of its own layer type (windowed or not, megatron-core's ``is_layer_window_attention``);
    anything else passes through unchanged."""

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if isinstance(rotary_pos_emb, LayerTypeRope):
            windowed = is_layer_window_attention(
                self.config.window_size, self.config.window_attn_skip_freq, self.layer_number
            )
            rotary_pos_emb = rotary_pos_emb.local if windowed else rotary_pos_emb.full
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
