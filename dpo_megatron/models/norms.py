"""Normalisation layers that work under sequence parallelism with the local (non-TE) spec.

megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel=True``. Under sequence
parallelism each TP rank normalises a different slice of the sequence, so the norm weight sees a
partial gradient on each rank; megatron-core's ``finalize_model_grads`` all-reduces the gradient of
every parameter marked ``sequence_parallel=True`` across the TP group. These modules mark their
parameters accordingly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from dpo_megatron.utils.saved_activations import recomputable


class _RMSNormFunction(torch.autograd.Function):
    """x [..., h], weight [h] -> weight * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) in fp32.

    The forward is ``LlamaRMSNorm``'s, op for op. Backward needs only x and rstd [..., 1]:
    autograd on those ops would also keep the normalised x (a second [..., h] tensor, and in
    bf16 an fp32 copy of x), so this saves one to two activations of the hidden size per norm.
    With y = x * rstd: dL/dx = rstd * (g - y * mean(g * y)), g = weight * dL/dout (in fp32),
    and dL/dweight = sum over tokens of dL/dout * y. Returns (out, rstd); rstd has no gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        return out, rstd

    @staticmethod
    def backward(ctx, grad_out, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        wide = rstd.dtype
        y = x.to(wide) * rstd
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            g = (grad_out * weight).to(wide)
            grad_x = (rstd * (g - y * (g * y).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (
                (grad_out.to(wide) * y.to(x.dtype).to(wide))
                .reshape(-1, x.shape[-1])
                .sum(0)
                .to(weight.dtype)
            )
        return grad_x, grad_weight, None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(weight * (x * rstd), rstd): :class:`_RMSNormFunction`'s forward, op for op."""
    x32 = x.to(_fp32_or_wider(x))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return _scale(x32, weight, rstd, x.dtype), rstd


def _scale(x32: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype):
    """weight * (x * rstd) with x in the norm's fp32 (or wider) and the product in ``dtype``:
    the last operations of :func:`_rms_norm`."""
    return weight * (x32 * rstd).to(dtype)


def _fp32_or_wider(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 (as HF), fp64 for fp64 (so gradcheck sees the exact function)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019, eq. 4), computed in fp32 like HF Llama.

    y = weight * (x / sqrt(mean(x^2) + eps)), with the normalisation in fp32 and the result cast
    back to the input dtype before the weight multiply (matches ``LlamaRMSNorm`` bit for bit).
    Backward keeps only x and the per-token rstd (:class:`_RMSNormFunction`); the output, which
    the next linear keeps for its weight gradient, is marked recomputable from them
    (``utils.saved_activations``: two element-wise passes in backward instead of the tensor).

    Shapes: x [..., hidden_size] -> [..., hidden_size].
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the same ops without the autograd function's cost
            return _rms_norm(x, self.weight, self.eps)[0]
        out, rstd = _RMSNormFunction.apply(x, self.weight, self.eps)
        weight = self.weight
        return recomputable(out, lambda: _scale(x.to(_fp32_or_wider(x)), weight, rstd, x.dtype))


class LayerNorm(torch.nn.Module):
    """Layer norm (Ba et al. 2016) with weight and bias, for GPT-2.

    Shapes: x [..., hidden_size] -> [..., hidden_size].
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in (self.weight, self.bias):
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group, whose backward sums the gradients over the group too: each rank's
    output feeds a different loss term, so the gradient of one rank's input is the sum of all
    ranks' output gradients. (megatron-core's ``reduce_from_tensor_model_parallel_region`` has an
    identity backward, right only when every rank's use of the sum is the same.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ProjectionRMSNorm(torch.nn.Module):
    """OLMo 2 / 3's query (or key) norm: one RMSNorm over the whole projection, all heads
    together (``Olmo3RMSNorm(num_heads * head_dim)`` applied before the heads are split), where
    Qwen3's normalises each head on its own.

    megatron-core builds it as its per-head ``q_layernorm`` / ``k_layernorm`` (argument
    ``hidden_size`` = head_dim) and calls it on [sq, b, heads / TP, head_dim]. Under tensor
    parallelism each rank holds heads / TP of the heads, so the sum of squares is all-reduced
    over the TP group (with autograd: every rank's output depends on every rank's inputs, so the
    backward all-reduces too) and the weight is split along with the heads (TP rank r: heads
    ``[r * n / TP, (r + 1) * n / TP)``, the order of the fused QKV's groups). The weight
    multiply happens in fp32 before the cast back, as ``Olmo3RMSNorm``.

    Shapes: x [sq, b, heads / TP, head_dim] -> the same.
    """

    heads_field = "num_attention_heads"
    """TransformerConfig field with this projection's head count (queries; keys: groups)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.eps = eps
        tp = config.tensor_model_parallel_size
        heads = getattr(config, self.heads_field)
        self.total = heads * hidden_size  # the whole projection's width
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(self.total // tp, dtype=config.params_dtype))
        # The input is the whole sequence (after the column-parallel QKV): no sequence-parallel
        # gradient reduction; the weight is a TP shard (grad norm and checkpoints count it so).
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1)
        x32 = flat.to(_fp32_or_wider(x))
        sum_sq = x32.pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None:
            sum_sq = _AllReduceSum.apply(sum_sq, self.tp_group)
        rstd = torch.rsqrt(sum_sq / self.total + self.eps)
        return (self.weight * (x32 * rstd)).to(x.dtype).view(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as a TP-sharded tensor (axis 0) in megatron-core's distributed checkpoint."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets
        )


class KeyProjectionRMSNorm(ProjectionRMSNorm):
    """:class:`ProjectionRMSNorm` of the keys: width key/value groups x head_dim."""

    heads_field = "num_query_groups"


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: ``(x / sqrt(mean(x^2) + eps)) * (1 + w)``, all in fp32, cast back at the
    end (``Gemma3RMSNorm``, op for op). The weight starts at 0 (the identity).

    Shapes: x [..., hidden_size] -> [..., hidden_size].
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(_fp32_or_wider(x))
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(x32.dtype))).to(x.dtype)


def norm_class(normalization: str, offset: bool = False) -> type[torch.nn.Module]:
    """The module for ``'RMSNorm'`` (:class:`OffsetRMSNorm` with ``offset``) or ``'LayerNorm'``.

    Raises:
        ValueError: for any other name.
    """
    classes = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}
    if normalization not in classes:
        raise ValueError(
            f"model.normalization must be one of {sorted(classes)}, got {normalization!r}"
        )
    if offset:
        if normalization != "RMSNorm":
            raise ValueError("model.norm_weight_offset=true needs model.normalization=RMSNorm")
        return OffsetRMSNorm
    return classes[normalization]
