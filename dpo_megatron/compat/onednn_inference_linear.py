"""megatron-core's linear layers multiplying with weights packed once for oneDNN, in a block of
forward-only work on the CPU (generation).

megatron-core's tensor-parallel linears compute ``input @ weight.t()`` with ``torch.matmul``,
which on the CPU is MKL's sgemm. sgemm copies the whole weight into its blocked layout at every
call, so a product of a few rows (a decode step: one token per completion) costs about twice
the weight's reading: on SmolLM2-135M at 8 rows, one thread, the 30 layers' products took 54 ms
and the LM head's 18.5 ms, against 31 ms and 7.5 ms with the weights packed once by oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by its ``_linear_pointwise``
(the pair torch's inductor uses on the CPU); 1.2x faster still at 512 rows (a prefill).
The products are the same up to the order of the sums (about 1e-6 relative).

:func:`packed_linears` packs the weight of every ``ColumnParallelLinear`` / ``RowParallelLinear``
of the given chunks (and the word embeddings, which a tied LM head passes in as its weight),
and gives each module a ``_forward_impl`` (megatron-core's private seam between a linear's
communication and its product) that multiplies with the packed weight while gradients are off,
and falls back to megatron-core's own otherwise (a weight it did not pack, sequence parallelism,
whose product gathers its input first, a dtype oneDNN does not take). On leaving the block the
modules get megatron-core's method back and the packed copies are freed. The packed copies hold
as many bytes as the weights, for the length of the block.

Switched on by generation when the engine's device is the CPU (``dpo_megatron.generation``); on
megatron-core 0.16 with a torch whose oneDNN ops are present (:func:`available`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="onednn_inference_linear",
        why="megatron-core's linears multiply with MKL's sgemm, which packs the whole weight at "
        "every call: a decode step of a few rows costs about twice its weights' reading",
        versions={"megatron-core": "==0.16.*", "torch": ">=2.6"},
        switched_on="by generation on the CPU, for the length of a generate call",
    )
)

DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes oneDNN's packed product takes."""


def available() -> bool:
    """Whether this torch has oneDNN and its packed linear ops, and the patch applies to the
    installed versions."""
    ops = torch.ops.mkldnn
    return (
        PATCH.applies_to_installed()
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout for :func:`packed_product`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_product(
    input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[..., in] @ weight.T (+ bias) -> [..., out] with a weight of :func:`pack`."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


_ACTIVE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
"""id -> (weight, packed) of the weights packed by the :func:`packed_linears` block in progress."""


def packed_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight``'s packed copy inside a :func:`packed_linears` block that packed it, else
    None (for :func:`packed_product`: a caller that multiplies by the weights itself, as the
    direct decode step does)."""
    entry = _ACTIVE.get(id(weight)) if weight is not None else None
    return entry[1] if entry is not None and entry[0] is weight else None


def _modules(chunks, *classes) -> Iterator[torch.nn.Module]:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, classes):
                yield module


def _packed_impl(module: torch.nn.Module, table: dict):
    """A ``_forward_impl`` for ``module``: the packed product of a weight in ``table`` (id ->
    (weight, packed)) under no grad, megatron-core's method otherwise."""
    original = type(module)._forward_impl.__get__(module)

    def forward_impl(input, weight, bias=None, **kwargs):
        entry = table.get(id(weight))
        if (
            entry is None
            or entry[0] is not weight
            or kwargs.get("sequence_parallel")
            or torch.is_grad_enabled()
            or input.dtype != weight.dtype
        ):
            return original(input, weight, bias, **kwargs)
        return packed_product(input, entry[1], bias)

    return forward_impl


@contextlib.contextmanager
def packed_linears(chunks) -> Iterator[int]:
    """Within the block, the linears of ``chunks`` multiply with oneDNN-packed weights while
    gradients are off (module docstring); a no-op where :func:`available` is False, and inside
    a block of the same chunks (a caller that generates several times in a row packs once by
    holding the block around its calls). Yields the number of weights packed (0 for a no-op).
    The weights must not change inside the block."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    patched = list(_modules(chunks, ColumnParallelLinear, RowParallelLinear))
    if not available() or any("_forward_impl" in m.__dict__ for m in patched):
        yield 0
        return
    # A tied LM head multiplies by the word embeddings: their weight is packed too.
    owners = patched + list(_modules(chunks, VocabParallelEmbedding))
    mine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for weight in (m.weight for m in owners if m.weight is not None):
        if weight.dtype in DTYPES and weight.device.type == "cpu" and id(weight) not in _ACTIVE:
            mine[id(weight)] = (weight, pack(weight))
    _ACTIVE.update(mine)
    for module in patched:
        module._forward_impl = _packed_impl(module, _ACTIVE)
    try:
        yield len(mine)
    finally:
        for module in patched:
            del module._forward_impl
        for key in mine:  # another block's weights (other chunks) stay packed
            del _ACTIVE[key]
