"""Activations that backward recomputes from tensors it keeps anyway, instead of keeping them.

A layer keeps, for its backward, tensors that are cheap functions of other kept tensors: a norm's
output (the next linear's input, for its weight gradient) is ``weight * (x * rstd)`` of the
norm's own saved ``x`` and ``rstd``; a SwiGLU product (the down projection's input) is
``SiLU(y_1) * y_2`` of the up projection's output ``y`` that the SwiGLU backward keeps. Keeping
such a tensor costs its bytes for the whole step; recomputing it costs a few element-wise passes
when its consumer's backward runs. A norm output and a SwiGLU product are about a quarter of a
Llama layer's activations (hidden size twice, half the feed-forward width once).

The producer marks its output (:func:`recomputable`: the function that makes it again, reading
only tensors the graph keeps anyway). Inside :func:`recompute_marked` (around a model's forward)
every tensor autograd saves passes ``torch.autograd.graph.saved_tensors_hooks``: a marked one is
saved as its recipe, every other one as itself. The recomputation runs the producer's own
operations on the same operands, so the unpacked tensor is bit for bit the one the forward made
(gradients unchanged; the module's tests check equality, not closeness). A view of a marked
tensor is saved as the same view of the remade one. A tensor saved by two consumers is
recomputed for each.

Same idea as megatron-core's output-discarding checkpoint (``CheckpointWithoutOutput``, its
``recompute_modules`` 'layernorm' / 'moe_act'), without a second forward graph: nothing but the
marked tensor is recomputed, and no autograd call is nested in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_RECIPE = "_dpo_megatron_recompute"
"""Attribute of a marked tensor: the function that makes it again."""


class _Recipe:
    """What a saved marked tensor (or a view of one) becomes until backward unpacks it."""

    __slots__ = ("make", "view")

    def __init__(self, make: Callable[[], torch.Tensor], view: tuple | None):
        self.make, self.view = make, view

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            tensor = self.make()
            return tensor if self.view is None else tensor.as_strided(*self.view)


def recomputable(tensor: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Mark ``tensor`` as one that :func:`recompute_marked` saves as ``make`` (returns it).

    Args:
        tensor: a freshly made output, never changed in place afterwards.
        make: a function of no arguments returning a tensor equal to ``tensor`` bit for bit (same
            shape, dtype and strides), reading only tensors that stay alive for backward anyway
            (its closure keeps them: give it only those).
    """
    setattr(tensor, _RECIPE, make)
    return tensor


def _pack(tensor: torch.Tensor):
    make = getattr(tensor, _RECIPE, None)
    if make is not None:
        return _Recipe(make, None)
    # A view of a marked tensor (an autograd function that returns its input, as megatron-core's
    # copy to the tensor-parallel region at TP 1 does, hands on an alias; a reshape): the same
    # view of the remade tensor.
    base = tensor._base
    make = None if base is None else getattr(base, _RECIPE, None)
    if make is None or tensor.dtype != base.dtype:
        return tensor
    return _Recipe(make, (tensor.size(), tensor.stride(), tensor.storage_offset()))


def _unpack(saved):
    return saved() if isinstance(saved, _Recipe) else saved


@contextlib.contextmanager
def recompute_marked() -> Iterator[None]:
    """Within the block, tensors marked :func:`recomputable` that autograd saves are kept as
    their recipes and made again in backward (module docstring); nothing changes while gradients
    are off."""
    if not torch.is_grad_enabled():
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
