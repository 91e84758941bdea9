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


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019, eq. 4), computed in fp32 like HF Llama.

    y = weight * (x / sqrt(mean(x^2) + eps)), with the normalisation in fp32 and the result cast
    back to the input dtype before the weight multiply (matches ``LlamaRMSNorm`` bit for bit).

    Shapes: x [..., hidden_size] -> [..., hidden_size].
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


def norm_class(normalization: str) -> type[torch.nn.Module]:
    """The module for ``'RMSNorm'`` or ``'LayerNorm'``.

    Raises:
        ValueError: for any other name.
    """
    classes = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}
    if normalization not in classes:
        raise ValueError(f"model.normalization must be one of {sorted(classes)}, "
                         f"got {normalization!r}")
    return classes[normalization]
