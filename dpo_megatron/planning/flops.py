"""Model FLOPs of the work this engine does (a multiply-add is 2 FLOPs).

Forward FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on
GPU Clusters", eq. 3, without the backward factor) for the tokens the engine actually runs: the
layers over every token (a shared prompt once), the LM head over completion tokens only (prompt
positions are never projected onto the vocabulary), attention over the (query, key) pairs each
token sees (4 x hidden per pair and layer: scores and the weighted sum). A mixture-of-experts
layer counts the experts a token is routed to (and the shared expert), not all of them.
"""

from __future__ import annotations


def forward_flops_per_token(
    layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int, context: float
) -> float:
    """Forward FLOPs of one token of a dense Llama-style model.

    Linear layers: 2 x weights (q, o: h^2 each; k, v: h^2 x groups/heads each; SwiGLU: 3 h ffn;
    LM head: h V). Attention scores and weighted sum: 2 x 2 x hidden x context per layer, with
    ``context`` the number of keys the token attends to (Narayanan et al. 2021 count the full
    sequence; a causal token attends to half of it on average).
    Example: Llama-3.2-1B, context 0 -> 2 x (16 x 60.8M + 262.7M) = 2.47 GFLOP.
    """
    kv = hidden * groups // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn
    return 2.0 * (layers * per_layer + hidden * vocab) + 4.0 * layers * hidden * context


def _causal(n: int) -> int:
    return n * (n + 1) // 2


def item_forward_flops(
    layer_flops_per_token: float,
    layers: int,
    hidden: int,
    vocab: int | None,
    prompt: int,
    completions: list[int],
    share_prompt: bool,
) -> float:
    """Forward FLOPs of one item (a pair: two completions; an SFT example: one).

    Args:
        layer_flops_per_token: FLOPs of all layers' linear layers for one token.
        layers, hidden: for attention (4 x hidden per (query, key) pair and layer).
        vocab: the LM head's width, over every completion token; None: a reward model (its
            [hidden -> 1] head is negligible).
        prompt: prompt tokens; completions: each completion's tokens.
        share_prompt: the prompt runs once (``packing.share_prompt``), each completion attending
            to it.

    Example (:func:`pair_forward_flops`): prompt 2, completions 1 and 1, shared: 4 tokens through
    the layers, attention pairs 3 + 3 (prompt + first completion, causal) + 1 x 2 + 1 (the second
    on the prompt and itself) = 9; unshared: 6 tokens, (3 + 3) x 2 = 12 pairs.
    """
    if share_prompt and len(completions) > 1:
        tokens = prompt + sum(completions)
        first, *rest = completions
        attention = _causal(prompt + first) + sum(c * prompt + _causal(c) for c in rest)
    else:
        tokens = sum(prompt + c for c in completions)
        attention = sum(_causal(prompt + c) for c in completions)
    head = 2.0 * hidden * vocab * sum(completions) if vocab else 0.0
    return layer_flops_per_token * tokens + head + 4.0 * layers * hidden * attention


def pair_forward_flops(
    shape: dict, prompt: int, chosen: int, rejected: int, share_prompt: bool
) -> float:
    """Forward FLOPs of one pair of a dense model given as ``model.*`` keys (``num_layers``,
    ``hidden_size``, ``ffn_hidden_size``, ``num_attention_heads``, ``num_query_groups``,
    ``vocab_size``): :func:`item_forward_flops` with two completions."""
    layers = forward_flops_per_token(
        shape["num_layers"],
        shape["hidden_size"],
        shape["ffn_hidden_size"],
        shape["num_attention_heads"],
        shape["num_query_groups"],
        vocab=0,
        context=0,
    )
    return item_forward_flops(
        layers,
        shape["num_layers"],
        shape["hidden_size"],
        shape["vocab_size"],
        prompt,
        [chosen, rejected],
        share_prompt,
    )


def layer_flops_per_token(model) -> float:
    """Forward FLOPs of every layer's linear layers for one token of a ``ModelConfig``: the
    attention projections (multi-latent attention's down and up projections), the MLP, or a
    mixture-of-experts layer's router, its ``moe_router_topk`` routed experts and its shared
    expert. Gated MLPs count 3 x hidden x ffn, plain ones 2 x."""
    from dpo_megatron.models.transformer_config import GATED

    h = model.hidden_size
    heads = model.num_attention_heads
    if model.kv_lora_rank is not None:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        q = (
            h * heads * qk
            if model.q_lora_rank is None
            else h * model.q_lora_rank + model.q_lora_rank * heads * qk
        )
        kv = h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank * heads * (
            model.qk_nope_head_dim + model.v_head_dim
        )
        attention = q + kv + heads * model.v_head_dim * h
    else:
        d = model.kv_channels or h // heads
        groups = model.num_query_groups or heads
        attention = 2 * h * heads * d + 2 * h * groups * d
    per_mlp = (3 if model.activation in GATED else 2) * h

    def mlp(ffn: int) -> int:
        return per_mlp * ffn

    total = 0
    for layer in range(model.num_layers):
        total += attention
        if model.num_experts and layer >= model.moe_first_dense_layers:
            ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
            total += h * model.num_experts + model.moe_router_topk * mlp(ffn)
            if model.moe_shared_expert_ffn_hidden_size:
                total += mlp(model.moe_shared_expert_ffn_hidden_size)
        else:
            total += mlp(model.ffn_hidden_size)
    return 2.0 * total
