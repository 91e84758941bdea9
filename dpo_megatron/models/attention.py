"""Core attention of the local layer spec, and the attention mask of packed rows.

A padded micro-batch needs no mask (one causal sequence per row). A packed row holds several
sequences; the batch then carries ``segment_ids`` [R, L] (``dpo_megatron.data.batch``) and
:func:`attention_mask_from_segments` turns them into what the core attention reads, on the
device, once per forward. One module owns that conversion and the kernels, selected by
``model.local_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.transformer.dot_product_attention import DotProductAttention


def attention_mask_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask of packed rows (True = masked, megatron-core's convention).

    Args:
        segment_ids: [R, L] int; positions with the same id belong to one sequence (a row's
            unused tail has an id of its own, so every position sees at least itself).

    Returns:
        [R, 1, L, L] bool, True where query t may not attend to key s: s > t, or another
        sequence. Built on ``segment_ids``' device.
    """
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    visible = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    return (~visible).unsqueeze(1)


class SDPAttention(DotProductAttention):
    """megatron-core's local core attention, computed by ``torch.nn.functional.
    scaled_dot_product_attention`` (fused flash / memory-efficient kernels on CPU and GPU).

    Same inputs and output as ``DotProductAttention`` (query [sq, b, np, hn], key / value
    [sk, b, ng, hn] -> context [sq, b, np * hn]), same math (softmax(q k^T * scale) v, causal or
    the given mask: True = masked), but the [b, np, sq, sk] scores and probabilities are neither
    materialised nor kept for backward: on SmolLM2-135M at 8 x 512 tokens that is 150 MB per layer
    and ~5x less attention time on CPU. Features it does not cover (sliding windows, softmax
    offsets, query-key layer scaling, attention dropout) fall back to the parent.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        unsupported = (self.scale_mask_softmax.window_size is not None
                       or self.softmax_offset is not None
                       or self.config.apply_query_key_layer_scaling
                       or (self.training and self.attention_dropout.p > 0)
                       or attention_bias is not None or packed_seq_params is not None)
        if unsupported:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
