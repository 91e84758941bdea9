"""megatron-core's frozen-weight linear runs the same matrix product as its trainable one.

``ColumnParallelLinear`` and ``RowParallelLinear`` (megatron-core 0.16) compute ``x W^T`` with
``torch.matmul(input, weight.t())`` on an input ``[s, b, h]``, in
``linear_with_grad_accumulation_and_async_allreduce`` when the weight trains and in
``linear_with_frozen_weight`` when it is frozen (a DPO reference, a LoRA base). torch's
``matmul`` of a 3-D input and a matrix chooses its kernel by a rule that reads
``requires_grad`` (``should_fold`` in ATen's ``LinearAlgebra.cpp``):

* the weight requires grad: the input is always folded into one ``[s * b, h]`` matrix (copied
  if its strides do not allow a view) and multiplied by one ``mm``;
* the weight is frozen: the input is folded only when its leading strides are row-major
  (``stride[i] == stride[i + 1] * size[i + 1]``); otherwise ``matmul`` runs a batched kernel,
  one ``[b, h] @ [h, k]`` product per position, whose sums round differently.

An input with strides ``(h, s * h, 1)`` is exactly what a micro-batch of one row gives: the
embedding's ``[b, s, h] -> [s, b, h]`` transpose followed by ``contiguous()``, which keeps the
strides of a tensor whose size-1 dimension makes it contiguous already; norms pass the strides
on. So with packing (one-row micro-batches) the reference's ``linear_qkv`` (and any other
linear given such an input, or a truly non-contiguous one) ran the batched kernel and the
policy's the ``mm``: at step 0, with equal weights, the log-probs differed in the last bits and
the rewards were float noise instead of 0.

Patched: the frozen path's input is made contiguous with row-major strides (a free view for
the one-row case, a copy for a non-contiguous input, which the trainable path copies too), so
``matmul`` folds it as it folds the trainable path's: the same ``mm`` on the same matrix, bit
for bit. The trainable path is unchanged. The frozen path saves no input for backward, so the
copy lives only as long as the product.

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` for every model.
"""

from __future__ import annotations

import functools

import torch

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="frozen_linear_fold",
        why="torch.matmul folds a 3-D input into one mm when the weight requires grad but, for "
        "a frozen weight, runs a batched kernel when the input's leading strides are not "
        "row-major (a one-row packed micro-batch): a frozen reference's linears round "
        "differently from the trainable policy's, and step-0 rewards are not exactly 0",
        versions={"megatron-core": "==0.16.*", "torch": ">=2.0"},
        switched_on="when a model is built (every model)",
    )
)

__all__ = ["PATCH", "enable", "row_major"]


def row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row-major strides: a view when ``x`` is contiguous (strides of size-1
    dimensions made canonical), else a contiguous copy. Same shape, same values."""
    return x.contiguous().view(x.shape)


def enable() -> bool:
    """Wrap ``megatron.core.tensor_parallel.layers.linear_with_frozen_weight`` (idempotent);
    True when the patch applies. The layers look the function up at each call, so layers
    built before it are covered too."""
    if not PATCH.applies_to_installed():
        return False
    from megatron.core.tensor_parallel import layers

    original = layers.linear_with_frozen_weight
    if getattr(original, "_row_major_input", False):
        return True

    @functools.wraps(original)
    def linear_with_frozen_weight(input, weight, *args, **kwargs):
        return original(row_major(input), weight, *args, **kwargs)

    linear_with_frozen_weight._row_major_input = True
    layers.linear_with_frozen_weight = linear_with_frozen_weight
    return True
