"""Count the bytes a rank allocates, as ``torch.cuda.memory_allocated`` /
``max_memory_allocated`` count them on a GPU, on a CPU-only machine.

:class:`AllocationTracker` is a ``TorchDispatchMode``: every aten op (factories, kernels,
the autograd engine's backward ops, in-place collectives' outputs) passes through it, and each
new storage of an op's outputs is counted once, from that op until torch frees it (a finalizer
on the storage object, which torch keeps alive as long as the storage lives, views included).
Tensors made before the tracker was entered are not counted: enter it before the engine builds
anything.

The plain CPU is the device here, not ``tests/strict_device.py``'s ``strict:0``: attention then
runs torch's fused (flash) CPU kernel, which saves what a GPU's flash kernel saves (queries,
keys, values, output and log-sum-exp), where a Python backend would fall back to the unfused
math path and keep [b, heads, s, s] probabilities no GPU run keeps. The price is that the few
host tensors of a run (token ids before they move, metrics copied back) count as well.

Usage, inside a rank (``run_ranks``)::

    with AllocationTracker() as memory:
        trainer = Trainer(cfg)
        trainer.train_step()
        memory.reset_peak()
        trainer.train_step()
    memory.peak   # bytes
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    """Bytes held by the storages ops made while this mode is active.

    Attributes:
        allocated: bytes held now.
        peak: the most bytes held at once since entering or the last :meth:`reset_peak`.
    """

    def __init__(self):
        super().__init__()
        self.allocated = 0
        self.peak = 0
        self._live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live.add(key)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.allocated -= nbytes

    def reset_peak(self) -> None:
        """Start a new peak from the bytes held now."""
        self.peak = self.allocated


def engine_static_bytes(trainer) -> dict[str, int]:
    """What a ``Trainer`` holds for the whole run on this rank, read off its objects, in the
    planner's terms (``dpo_megatron.planning.memory``):

    * ``params``: elements of the policy's parameters;
    * ``weights``: megatron-core DDP's parameter buffers, and every parameter outside them;
    * ``grads``: the DDP gradient buffers;
    * ``optimizer``: the inner torch optimizers' parameters that are not model or buffer
      storage (the fp32 main copies of bf16 weights) and their state tensors (Adam's moments;
      the 0-dim step counters left out).
    """
    buffers = [
        b
        for chunk in trainer.policy
        for b in list(getattr(chunk, "buffers", []))
        + list(getattr(chunk, "expert_parallel_buffers", []))
    ]
    held, weights, grads = set(), 0, 0
    for b in buffers:
        grads += b.grad_data.untyped_storage().nbytes()
        held.add(b.grad_data.untyped_storage().data_ptr())
        if b.param_data is not None:
            weights += b.param_data.untyped_storage().nbytes()
            held.add(b.param_data.untyped_storage().data_ptr())
    params = 0
    for chunk in trainer.policy:
        for p in chunk.parameters():
            params += p.numel()
            ptr = p.untyped_storage().data_ptr()
            if ptr not in held:
                weights += p.numel() * p.element_size()
            held.add(ptr)
    optimizer, seen = 0, set()
    for wrapper in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = wrapper.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                ptr = p.untyped_storage().data_ptr()
                if ptr not in held and ptr not in seen:
                    seen.add(ptr)
                    optimizer += p.numel() * p.element_size()
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    optimizer += value.numel() * value.element_size()
    return {"params": params, "weights": weights, "grads": grads, "optimizer": optimizer}
