"""megatron-core's multi-latent attention at TP > 1 on the local spec: the shared RoPE key's
gradient summed over the tensor-parallel ranks.

``MLASelfAttention.get_query_key_value_tensors`` (megatron-core 0.16) runs the key/value down
projection as a ``ColumnParallelLinear`` on the local spec: each TP rank computes a column slice
of ``[latent (kv_lora_rank) | RoPE key (qk_pos_emb_head_dim)]``, the slices are gathered over TP
(``gather_from_tensor_model_parallel_region``: all-gather forward, keep-your-slice backward) and
split into the latent and the RoPE key ``k_pos_emb`` [s, b, rope]. Every head shares that key,
but a TP rank uses it for its own heads only, so its gradient on each rank holds only that rank's
heads' share; the gather's backward then keeps each rank's own columns, and the RoPE columns (in
the last rank's slice) get only the last rank's share. The latent's gradient is whole on every
rank (its up projection reduces over TP), so only the RoPE key is affected: the forward is exact,
and the backward at TP 2 differs from TP 1 (DeepSeek-V3: the step-1 gradient norm ~1e-4
relative). transformer-engine's spec takes another route (a duplicated linear, the RoPE key
gathered over the sequence-parallel region, whose backward sums over TP).

:func:`enable` wraps the module's gather: the tensor named by :func:`mark_rope_key_source` (the
down projection's output, which :class:`~dpo_megatron.models.mla.DPOMLASelfAttention` names from
a forward hook) is gathered with the gradient of its last ``rope`` columns summed over the TP
group before the slice is kept; every other gather is unchanged.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when it builds a multi-latent
attention model at TP > 1 on the local spec.
"""

from __future__ import annotations

import torch

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="mla_rope_key_grad",
        why="megatron-core 0.16's multi-latent attention with a column-parallel key/value down "
        "projection keeps one TP rank's share of the shared RoPE key's gradient: the backward "
        "at TP > 1 differs from TP 1",
        versions={"megatron-core": "==0.16.*"},
        switched_on="when a multi-latent attention model is built at TP > 1 on the local spec",
    )
)

__all__ = ["PATCH", "enable", "mark_rope_key_source"]

_SOURCE: tuple[torch.Tensor, int] | None = None
"""(this rank's slice of the key/value down projection, RoPE columns at the gathered end): set
by the layer's forward hook, taken by the next gather of that very tensor."""


class _SumRopeGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the last ``rope`` columns of the gradient over ``group``
    (the TP ranks' shares of the shared RoPE key) and passes the rest unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rope: int, group) -> torch.Tensor:
        ctx.rope, ctx.group = rope, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.clone()
        rope = grad[..., -ctx.rope :].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.rope :] = rope
        return grad, None, None


def mark_rope_key_source(shard: torch.Tensor, rope: int) -> None:
    """Name ``shard`` (this rank's columns of MLA's key/value down projection, [s, b, C/TP]) as
    the tensor whose gather ends in ``rope`` RoPE-key columns (module docstring)."""
    global _SOURCE
    _SOURCE = (shard, rope)


def enable() -> bool:
    """Wrap ``multi_latent_attention.gather_from_tensor_model_parallel_region``. Idempotent.

    Returns True when the wrapper is (now) in place.
    """
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.transformer import multi_latent_attention as mla

    original = mla.gather_from_tensor_model_parallel_region
    if getattr(original, "_dpo_rope_key_grad", False):
        return True

    def gather(input_, group=None):
        from megatron.core.parallel_state import get_tensor_model_parallel_group

        global _SOURCE
        out = original(input_, group)
        if _SOURCE is not None and input_ is _SOURCE[0]:
            group = group if group is not None else get_tensor_model_parallel_group()
            out = _SumRopeGradOverTP.apply(out, _SOURCE[1], group)
            _SOURCE = None  # taken: the next layer names its own
        return out

    gather._dpo_rope_key_grad = True
    mla.gather_from_tensor_model_parallel_region = gather
    return True
