"""megatron-core's all-to-all MoE token dispatcher on the CPU (gloo).

``MoEAlltoAllTokenDispatcher`` (megatron-core 0.16) overlaps the device-to-host copy of its
split sizes with compute on a side CUDA stream: it creates ``torch.cuda.Stream()`` when the first
MoE layer is built, compares ``torch.cuda.current_stream()`` with it, enters
``torch.cuda.stream(...)`` and waits on an event recorded there. Without CUDA each of these
raises. On the host there is one stream and every copy is synchronous, so :func:`enable` gives
``torch.cuda`` a host stream whose waits, events and context are no-ops.

With expert tensor parallelism the dispatcher also all-gathers and reduce-scatters the tokens of
the expert-TP ranks in *uneven* pieces (``gather_from_sequence_parallel_region`` /
``reduce_scatter_to_sequence_parallel_region`` with split sizes). gloo refuses both ("invalid
tensor size"). :func:`enable` routes those two cases, on gloo groups only, through equal-size
collectives: the uneven gather pads every piece to the longest, gathers and drops the padding;
the uneven reduce-scatter all-reduces the whole tensor and keeps this rank's piece. Both give the
same values as the uneven collectives would (sums of the same pieces).

The same code path turns the split sizes into host numbers with ``maybe_move_tensor_to_cpu(...,
as_numpy=True)``, which converts only CUDA tensors; on the CPU the splits stay tensors and
``all_to_all_single`` rejects them (it takes sequences of ints). :func:`enable` gives the
dispatcher a version that also converts host tensors. The collective itself
(``all_to_all_single`` with uneven splits) then runs on gloo as it is (torch 2.13).

Switched on by ``dpo_megatron.models.gpt.build_model_chunks`` when it builds a mixture-of-experts
model with ``model.moe_token_dispatcher=alltoall`` and the engine's device is the CPU. Never on a
CUDA device (the real streams are used there).
"""

from __future__ import annotations

import torch

from dpo_megatron.compat.registry import Patch, register

PATCH = register(
    Patch(
        name="moe_alltoall_on_cpu",
        why="megatron-core 0.16's all-to-all MoE dispatcher creates and synchronises a side CUDA "
        "stream for its device-to-host copies; without CUDA torch.cuda.Stream raises",
        versions={"megatron-core": "==0.16.*", "torch": ">=2.6"},
        switched_on="when a mixture-of-experts model with the alltoall dispatcher is built on the "
        "CPU device (gloo)",
    )
)

__all__ = ["PATCH", "enable", "is_enabled", "HostStream"]

_ENABLED = False


class HostEvent:
    """An event of the host stream: the work before it is already done."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class HostStream:
    """The host's single stream: work runs in program order, so waiting is a no-op (every
    instance is the same stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> HostEvent:
        return event if event is not None else HostEvent()

    def synchronize(self) -> None:
        return None

    def __eq__(self, other) -> bool:
        return isinstance(other, HostStream)

    def __hash__(self) -> int:
        return 0


class _HostStreamContext:
    """``torch.cuda.stream(s)`` on the host: nothing to switch."""

    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc) -> bool:
        return False


_HOST_STREAM = HostStream()


def enable() -> bool:
    """Give ``torch.cuda`` the host stream (``Stream``, ``current_stream``, ``stream``).

    Idempotent; a no-op on a CUDA machine and on other megatron-core versions.

    Returns:
        True when the patch is active.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available() or not PATCH.applies_to_installed():
        return False
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    # A class, not a function: other libraries annotate with ``torch.cuda.Stream | None``.
    torch.cuda.Stream = HostStream
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = _HostStreamContext
    token_dispatcher.maybe_move_tensor_to_cpu = host_copy
    _ORIGINAL.update(
        gather=mappings._gather_along_first_dim,
        reduce_scatter=mappings._reduce_scatter_along_first_dim,
    )
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
    _ENABLED = True
    return True


_ORIGINAL: dict = {}


def _uneven_on_gloo(group, split_sizes) -> bool:
    return (
        split_sizes is not None
        and group.size() > 1
        and torch.distributed.get_backend(group) == "gloo"
        and len(set(split_sizes)) > 1
    )


def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """megatron-core's ``_gather_along_first_dim``; uneven pieces on gloo by padding.

    Shapes: input_ [output_split_sizes[rank], ...] -> [sum(output_split_sizes), ...].
    """
    if not _uneven_on_gloo(group, output_split_sizes):
        return _ORIGINAL["gather"](input_, group, output_split_sizes, use_global_buffer)
    longest = max(output_split_sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    pieces = [torch.empty_like(padded) for _ in range(group.size())]
    torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(pieces, output_split_sizes)], dim=0)


def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """megatron-core's ``_reduce_scatter_along_first_dim``; uneven pieces on gloo through an
    all-reduce of the whole tensor.

    Shapes: input_ [sum(input_split_sizes), ...] -> [input_split_sizes[rank], ...].
    """
    if not _uneven_on_gloo(group, input_split_sizes):
        return _ORIGINAL["reduce_scatter"](input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    rank = group.rank()
    start = sum(input_split_sizes[:rank])
    return total[start : start + input_split_sizes[rank]].contiguous()


def host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for host tensors: a tensor (or, with
    ``as_numpy``, a NumPy array) on the CPU; anything else unchanged."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def is_enabled() -> bool:
    """Whether :func:`enable` is active in this process."""
    return _ENABLED
