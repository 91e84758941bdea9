"""A decode step of a dense pre-norm GPT chunk computed directly from its modules, on the CPU.

A decode step feeds one token per row through every layer. Through megatron-core's modules that
is about a hundred torch operations per layer besides its four products (module wrappers, the
tensor-parallel region functions, the query/key/value split, RoPE's cos / sin recomputed in
every layer, the bias-dropout-add), which at a few rows cost more than the products themselves.
:class:`DirectDecoder` runs the same computation as a short loop over the layers: the norms are
the layers' own modules, the products the oneDNN-packed ones of
``compat.onednn_inference_linear`` (the same call the packed modules make), the activation
megatron-core's ``swiglu`` (what its MLP's ``bias_swiglu_impl`` computes without a bias; on the
CPU the eager function of ``compat.eager_fusions``), the attention the engine's cached
attention (``models.attention.cached_attention``, the cache the prefill filled), and RoPE
megatron-core's own ``apply_rotary_pos_emb`` with one angle table per step for every layer
(``compat.rope_tables_once`` then makes its cos / sin once a step). Every operation is the
one megatron-core's forward makes on the same operands in the same order, so the logits are
bit for bit the schedule's (tested), and generation chooses the same tokens whichever path
runs.

The rows of every live micro-batch go through one step together, up to :data:`DECODE_ROWS`:
each product reads its weight once for all of them (a product of 8 rows runs at about half this
CPU's fp32 peak, one of 64 at the peak), and each micro-batch attends to its own cache. A
micro-batch's logits are then the schedule's up to the order of the products' fp32 sums.

It serves what the loop covers and nothing else (:func:`unsupported` says why not): one
chunk holding the whole model (no pipeline or tensor parallelism), megatron-core's plain
``TransformerLayer`` and ``SelfAttention`` (query/key norms allowed), RoPE on the whole head or
none, the local core attention without a sliding window, attention sinks or a softmax offset,
a gated SiLU MLP (SwiGLU), no mixture of experts, no multi-latent attention, no forward hooks
(LoRA adapters), no bias added after a product, every product packed. Anything else decodes
through the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import (
    SelfAttention,
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from dpo_megatron.compat.onednn_inference_linear import packed_product, packed_weight
from dpo_megatron.models.attention import LocalAttention, cached_attention
from dpo_megatron.models.kv_cache import KVCache
from dpo_megatron.models.norms import LayerNorm, RMSNorm
from dpo_megatron.parallel.host_malloc import HeapTrimmer
from dpo_megatron.utils.modules import unwrap

_NORMS = (RMSNorm, LayerNorm)


def _linears_problem(attention, mlp) -> str | None:
    """Why the direct loop cannot multiply by a layer's linears, or None."""
    for linear, kind in (
        (attention.linear_qkv, ColumnParallelLinear),
        (attention.linear_proj, RowParallelLinear),
        (mlp.linear_fc1, ColumnParallelLinear),
        (mlp.linear_fc2, RowParallelLinear),
    ):
        if type(linear) is not kind or packed_weight(linear.weight) is None:
            return f"{type(linear).__name__} without a packed weight"
        if linear.bias is not None and linear.skip_bias_add:
            return "a linear bias added after the product"
    return None


def _layer_problem(layer) -> str | None:
    """Why the direct loop cannot compute ``layer``, or None."""
    if type(layer) is not TransformerLayer:
        return f"layer class {type(layer).__name__}"
    attention, mlp = layer.self_attention, layer.mlp
    if type(attention) is not SelfAttention or type(mlp) is not MLP:
        return f"{type(attention).__name__} / {type(mlp).__name__}"
    core = attention.core_attention
    if not isinstance(core, LocalAttention) or core.window is not None:
        return "core attention other than the local one without a sliding window"
    if core.softmax_offset is not None or core.config.apply_query_key_layer_scaling:
        return "attention sinks, a softmax offset or query-key layer scaling"
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
        if type(norm) not in _NORMS:
            return f"norm {type(norm).__name__}"
    for norm in (attention.q_layernorm, attention.k_layernorm):
        if norm is not None and type(norm) is not IdentityOp and type(norm) not in _NORMS:
            return f"query/key norm {type(norm).__name__}"
    if type(layer.pre_cross_attn_layernorm) is not IdentityOp:
        return "cross attention"
    problem = _linears_problem(attention, mlp)
    if problem:
        return problem
    config = layer.config
    if config.attention_output_gate:
        return "a gated attention output"
    if not (
        config.gated_linear_unit
        and config.bias_activation_fusion
        and mlp.activation_func is torch.nn.functional.silu
    ):
        return "an MLP other than SwiGLU"
    return None


def unsupported(chunks) -> str | None:
    """Why :class:`DirectDecoder` cannot serve ``chunks`` (one line), or None when it can.
    Call it inside the block of ``compat.onednn_inference_linear.packed_linears``: the
    products must be packed."""
    if len(chunks) != 1:
        return "more than one model chunk"
    model = unwrap(chunks[0])
    config = model.config
    if not (model.pre_process and model.post_process):
        return "pipeline parallelism"
    if config.tensor_model_parallel_size > 1 or config.context_parallel_size > 1:
        return "tensor or context parallelism"
    if config.num_moe_experts or config.multi_latent_attention:
        return "mixture of experts or multi-latent attention"
    if getattr(model, "reward_head", None) is not None or model.embedding_scale is not None:
        return "a reward head or an embedding scale"
    if model.position_embedding_type not in ("rope", "none"):
        return f"{model.position_embedding_type} position embeddings"
    if model.position_embedding_type == "rope" and (
        config.rotary_interleaved
        or getattr(model, "local_rotary_pos_emb", None) is not None
        or type(model.rotary_pos_emb) is not RotaryEmbedding
        or model.rotary_pos_emb.get_emb(1).shape[-1] != config.kv_channels
    ):
        return "RoPE other than plain rotation of the whole head"
    if config.fp32_residual_connection or config.apply_residual_connection_post_layernorm:
        return "fp32 or post-norm residual connections"
    hooked = _hooked_module(model)
    if hooked:
        return f"a forward hook on {hooked} (LoRA adapters)"
    if packed_weight(_output_weight(model)) is None:
        return "an LM head without a packed weight"
    for layer in model.decoder.layers:
        problem = _layer_problem(layer)
        if problem:
            return problem
    return None


def _hooked_module(model) -> str | None:
    """The name of a module of ``model`` with a forward hook or pre-hook the direct loop would
    skip, or None. Two kinds are known and harmless: the heap trimmer's after a layer
    (``parallel.host_malloc``: memory only) and the LM head's vocabulary padding mask
    (``models.gpt``: :meth:`DirectDecoder.logits` applies it itself)."""
    for name, module in model.named_modules():
        for hook in [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]:
            if not (isinstance(hook, HeapTrimmer) or getattr(hook, "masks_vocab_padding", False)):
                return name or "the model"
    return None


def _output_weight(model) -> torch.Tensor:
    return (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )


class _Linear:
    """A linear layer's packed weight and its bias, which megatron-core adds in the product
    (a bias it adds after the product, ``skip_bias_add``, is refused by :func:`unsupported`)."""

    def __init__(self, linear):
        self.packed, self.bias = packed_weight(linear.weight), linear.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b."""
        return packed_product(x, self.packed, self.bias)


class _Layer:
    """What a decode step reads of one ``TransformerLayer``, looked up once."""

    def __init__(self, layer):
        attention, mlp = layer.self_attention, layer.mlp
        # forward, not __call__: no hooks to run (unsupported() checked), one call less
        self.input_norm = layer.input_layernorm.forward
        self.mlp_norm = layer.pre_mlp_layernorm.forward
        self.qkv, self.proj = _Linear(attention.linear_qkv), _Linear(attention.linear_proj)
        self.fc1, self.fc2 = _Linear(mlp.linear_fc1), _Linear(mlp.linear_fc2)
        self.norms = tuple(
            None if norm is None or type(norm) is IdentityOp else norm.forward
            for norm in (attention.q_layernorm, attention.k_layernorm)
        )
        self.core = attention.core_attention
        self.config, self.cp_group = layer.config, attention.pg_collection.cp
        self.mscale = _yarn_get_concentration_factor_from_config(layer.config)
        self.groups = attention.num_query_groups_per_partition
        self.per_group = attention.num_attention_heads_per_partition // self.groups
        self.head = attention.hidden_size_per_attention_head

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """megatron-core's RoPE as its attention applies it (``apply_rotary_pos_emb``, Su et al.
        2021, eq. 34; with ``compat.rope_tables_once`` the cos / sin of one ``freqs`` tensor
        are made once for every layer)."""
        return apply_rotary_pos_emb(
            t, freqs, config=self.config, mscale=self.mscale, cp_group=self.cp_group
        )

    def __call__(
        self, hidden: torch.Tensor, rope, caches: list[tuple[KVCache, int]]
    ) -> torch.Tensor:
        """[R, h] -> [R, h]: megatron-core's ``TransformerLayer`` forward of one slot per row
        (``rope``: the step's angles, [1, R, 1, 1, dim] and its [1, R, 1, dim] view, or None),
        the rows of one or more micro-batches one after another (``caches``: each micro-batch's
        cache and row count, in row order). Everything but the attention is row by row, so the
        micro-batches share each product; each attends to its own cache."""
        rows, per_group, head = hidden.shape[0], self.per_group, self.head
        qkv = self.qkv(self.input_norm(hidden)).view(1, rows, self.groups, per_group + 2, head)
        if rope is not None and self.norms == (None, None):
            # a group's query heads and its key head in one rotation (the same operations on
            # every element as rotating each)
            rotated = self._rotate(qkv[:, :, :, : per_group + 1], rope[0])
            query, key = rotated[:, :, :, :per_group], rotated[:, :, :, per_group]
        else:
            query, key = qkv[:, :, :, :per_group], qkv[:, :, :, per_group]
            query = query.reshape(1, rows, -1, head)
            if self.norms[0] is not None:
                query = self.norms[0](query)
            if self.norms[1] is not None:
                key = self.norms[1](key)
            if rope is not None:
                query, key = self._rotate(query, rope[1]), self._rotate(key, rope[1])
        query, value = query.reshape(1, rows, -1, head), qkv[:, :, :, per_group + 1]
        core, start, contexts = self.core, 0, []
        for cache, count in caches:
            part = slice(start, start + count)
            contexts.append(
                cached_attention(
                    core,
                    query[:, part],
                    key[:, part],
                    value[:, part],
                    cache,
                    core.softmax_scale,
                    None,
                )[0]
            )
            start += count
        context = contexts[0] if len(contexts) == 1 else torch.cat(contexts)
        hidden = self.proj(context).add_(hidden)
        # what megatron-core's bias_swiglu_impl computes without a bias, less its autograd
        # function (the eager function of compat.eager_fusions on the CPU)
        activated = fused_bias_swiglu.swiglu(self.fc1(self.mlp_norm(hidden)))
        return self.fc2(activated).add_(hidden)


DECODE_ROWS = 64
"""Most rows of one direct decode forward. A product of 64 rows runs at about this CPU's fp32
peak (100 GFLOP/s on one core; 8 rows: about 50), so more would add memory (the LM head's [rows,
V] logits), not speed."""


class DirectDecoder:
    """The decode step of one whole-model chunk as a loop over its layers (module docstring).
    Build it inside the ``packed_linears`` block whose packed weights it multiplies by.

    Args:
        chunk: the model chunk (DDP-wrapped or not); :func:`unsupported` must be None for it.
    """

    def __init__(self, chunk):
        self.model = model = unwrap(chunk)
        self.layers = [_Layer(layer) for layer in model.decoder.layers]
        self.head = packed_weight(_output_weight(model))
        self._tables: dict[int, torch.Tensor] = {}

    def _angles(self, positions: torch.Tensor, capacity: int):
        """The RoPE angles of each row's position, [1, R, 1, 1, dim] and its [1, R, 1, dim]
        view (the table of ``capacity`` positions built once per capacity: a position's angles
        are the same in every table), or None without RoPE. One pair of tensors serves every
        layer of the step, so the rotation's cos / sin are made once
        (``compat.rope_tables_once``)."""
        if self.model.position_embedding_type != "rope":
            return None
        if capacity not in self._tables:
            self._tables[capacity] = self.model.rotary_pos_emb.get_emb(capacity)[:, 0, 0, :]
        freqs = self._tables[capacity][positions][None, :, None, None, :]
        return freqs, freqs[:, :, 0]

    @torch.no_grad()
    def logits(self, steps: Sequence[tuple[torch.Tensor, torch.Tensor, KVCache]]) -> list:
        """The next-token logits of one decode step of one or more micro-batches, their rows
        through each product together, at most :data:`DECODE_ROWS` at a time (a step of a few
        rows reads every weight for little arithmetic: 8 micro-batches of 8 rows read them 8
        times, one of 64 once).

        Args:
            steps: per micro-batch (tokens [R] int64, each row's newest token, an idle row's
                any id; positions [R] int64, its position in its row; its cache, the next slot
                already appended: :meth:`KVCache.append` of [R, 1]).

        Returns:
            Per micro-batch, [R, V] logits in the model's dtype (V the padded vocabulary).
        """
        out, group = [], []
        for step in steps:
            if group and sum(len(t) for t, _, _ in group) + len(step[0]) > DECODE_ROWS:
                out += self._group_logits(group)
                group = []
            group.append(step)
        return out + self._group_logits(group) if group else out

    def _group_logits(self, steps) -> list:
        """:meth:`logits` of micro-batches whose rows make one forward together."""
        tokens = torch.cat([t for t, _, _ in steps]) if len(steps) > 1 else steps[0][0]
        positions = torch.cat([p for _, p, _ in steps]) if len(steps) > 1 else steps[0][1]
        caches = [(c, len(t)) for t, _, c in steps]
        hidden = self.model.embedding.word_embeddings.weight[tokens]  # [R, h]
        rope = self._angles(positions, max(c.capacity for c, _ in caches))
        for layer in self.layers:
            hidden = layer(hidden, rope, caches)
        logits = packed_product(self.model.decoder.final_layernorm(hidden), self.head)
        valid = self.model.vocab_valid_columns
        if valid is not None:  # the LM head's padding mask (models.gpt), as its hook applies it
            logits[:, valid:] = float("-inf")
        return list(logits.split([n for _, n in caches]))
