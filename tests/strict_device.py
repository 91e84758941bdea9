"""``strict:0``: a stand-in accelerator for CPU-only machines that fails where a GPU would.

On a CPU machine the engine's device is the host, so a tensor left on the host (a norm weight
made with ``torch.ones(...)``, a flag made without ``device=``) goes unnoticed; on a GPU the
first op that mixes it with a device tensor raises. This module gives the engine a device that
is not the host and behaves like CUDA where it matters:

* ``strict`` is torch's ``PrivateUse1`` backend renamed, set up as a Python backend
  (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``);
* a tensor on it is a :class:`StrictTensor`: a ``__torch_dispatch__`` wrapper that reports
  ``strict:0`` and keeps its values in a CPU tensor (``.elem``). Every aten op unwraps its
  strict operands, computes on the CPU and wraps the results again;
* an op given a strict tensor and a host tensor of one dimension or more raises, with CUDA's
  message (:class:`StrictDeviceError`). As on CUDA, 0-dim host tensors (CPU scalars) are
  accepted, copies cross (``copy_``, ``.to``, ``.cpu()``) and index tensors of advanced
  indexing (``t[idx]``, ``t[idx] = v``) may live on the host;
* factory calls with ``device="strict"`` (``torch.zeros``, ``torch.tensor``, ``.to``, ...) make
  strict tensors (``empty`` / ``empty_strided`` / ``_copy_from`` are registered for the backend
  with ``torch.library``; every other factory decomposes into them; ``_local_scalar_dense``
  serves ``torch.tensor([strict scalars])``, which reads values with the Python key excluded);
* ``torch.distributed`` collectives run on the strict tensors' CPU storage in place (gloo takes
  only CPU tensors), and refuse a host tensor as NCCL does, except on groups created with an
  explicit ``backend="gloo"`` (megatron-core's ``*_GLOO`` groups, which take host tensors on a GPU
  run too).

:class:`StrictDevice` points the engine at ``strict:0`` through its one seam,
:func:`dpo_megatron.parallel.device.set_gloo_device`; megatron-core's CUDA requests then land
there as well (:mod:`dpo_megatron.compat.cuda_on_cpu`). Usage, inside a rank (``run_ranks``),
before anything is built::

    with StrictDevice():
        Trainer(cfg).train()      # raises StrictDeviceError where a GPU run would fail

Importing this module changes nothing; :func:`install` (run by :class:`StrictDevice`) registers
the backend for the rest of the process, and ``torch.accelerator`` then reports ``strict``, as
it reports ``cuda`` on a GPU machine: install it in rank processes only, never in the pytest
process.

Harness details that a GPU does not need:

* ``host_tensor.data = strict_tensor`` moves a tensor to the device on CUDA; a host tensor
  cannot become a wrapper by a metadata swap, so while a :class:`StrictDevice` is active the
  Python object is given a strict tensor in place (``torch.utils.swap_tensors``, keeping its
  identity, ``requires_grad`` and attributes: megatron-core's DDP does this to parameters it
  moves into its buffers). The reverse (``strict.data = host``) is handled the same way.
* ``data_ptr()``, ``untyped_storage()`` and ``tolist()`` answer from the CPU tensor behind
  the wrapper (the wrapper itself has no storage); ``numpy()`` refuses, as on CUDA.
* megatron-core's notice "CPU RNG state changed within GPU RNG context" is dropped: its GPU
  branch initialises weights in a fork of the CUDA generator, which without CUDA is the CPU's.

Values are the CPU's: the stand-in proves placement, not kernels.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_TYPE = "strict"
DEVICE = f"{DEVICE_TYPE}:0"
"""The stand-in device, as a ``device=`` argument (valid once :func:`install` ran)."""
aten = torch.ops.aten

# Ops CUDA runs with operands on two devices: copies and moves.
_CROSSING = {
    aten.copy_.default,
    aten._to_copy.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
}
# Ops whose second argument is a list of index tensors that CUDA moves to the device itself.
_HOST_INDICES = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}
# torch.distributed functions that take tensors (NCCL refuses host tensors in all of them).
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
_OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
)
"""Collectives of Python objects: they pickle into a tensor on their ``device`` argument (by
default the backend's: CUDA for NCCL). Told ``device=cpu`` on a GPU run, NCCL refuses it."""


class StrictDeviceError(RuntimeError):
    """An op or collective mixed ``strict:0`` tensors with host tensors (CUDA / NCCL would
    refuse it)."""


class StrictTensor(torch.Tensor):
    """A tensor on ``strict:0``: the wrapper reports the device, shape, strides and dtype; the
    values live in ``elem``, a CPU tensor of the same shape and strides.

    Attributes:
        elem: the CPU tensor holding the values (views of one strict tensor share its storage).
    """

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        if isinstance(elem, StrictTensor) or elem.device.type != "cpu":
            raise TypeError(
                f"StrictTensor wraps a plain CPU tensor, got {type(elem).__name__} on {elem.device}"
            )
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=False,
        )
        out.elem = elem
        return out

    def __repr__(self, *, tensor_contents=None):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"StrictTensor({self.elem!r}, device='{DEVICE}'{grad})"

    def __deepcopy__(self, memo):
        # Tensor.__deepcopy__ would rebuild from the wrapper's (empty) storage.
        if id(self) not in memo:
            copied = StrictTensor(self.elem.clone()).requires_grad_(self.requires_grad)
            memo[id(self)] = copied
            for key, value in self.__dict__.items():
                if key != "elem":
                    setattr(copied, key, copy.deepcopy(value, memo))
        return memo[id(self)]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        override = _function_override(func)
        if override is not None:
            return override(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_operands(func, args, kwargs)
        return _run_on_cpu(func, args, kwargs)


# -- aten ops ------------------------------------------------------------------------------------


def _is_strict_device(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == DEVICE_TYPE


def _mismatch(what: str, host: list) -> StrictDeviceError:
    shapes = ", ".join(str(tuple(t.shape)) for t in host)
    return StrictDeviceError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{DEVICE} and cpu! ({what} was given host tensor(s) of shape {shapes} beside "
        f"{DEVICE} tensors: tests/strict_device.py)"
    )


def _check_operands(func, args, kwargs) -> None:
    """Raise :class:`StrictDeviceError` when ``func`` meets a strict tensor and a host tensor of
    dim >= 1 (CUDA's rule: 0-dim CPU scalars, copies and the host index lists of advanced
    indexing into a strict tensor pass)."""
    if func in _CROSSING:
        return
    operands = (args, kwargs)
    if func in _HOST_INDICES and isinstance(args[0], StrictTensor):  # (self, indices, ...)
        operands = ((args[0], *args[2:]), kwargs)
    host = [
        t
        for t in tree_flatten(operands)[0]
        if isinstance(t, torch.Tensor) and not isinstance(t, StrictTensor) and t.dim() > 0
    ]
    if host:
        raise _mismatch(f"aten op {func}", host)


def _run_on_cpu(func, args, kwargs):
    """``func`` on the CPU tensors behind the strict operands; new tensors come back strict
    (host tensors when the op was asked for ``device="cpu"``), in-place results are the
    operands themselves."""
    inputs: dict[int, torch.Tensor] = {}

    def unwrap(x):
        if isinstance(x, StrictTensor):
            inputs[id(x.elem)] = x
            return x.elem
        if isinstance(x, torch.Tensor):
            inputs[id(x)] = x
        return x

    to_host = (
        "device" in kwargs
        and kwargs["device"] is not None
        and not _is_strict_device(kwargs["device"])
    )
    args, kwargs = tree_map(unwrap, (args, kwargs))
    if _is_strict_device(kwargs.get("device")):
        kwargs["device"] = torch.device("cpu")
    out = func(*args, **kwargs)

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in inputs:  # an in-place or out= result: the operand itself
            return inputs[id(x)]
        return x if to_host else StrictTensor(x)

    return tree_map(wrap, out)


# -- Python-level Tensor methods that do not reach the dispatcher --------------------------------

_DATA_ATTR = torch._C.TensorBase.data


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.data = value``. Between two strict tensors torch swaps the wrapper's metadata and
    the values follow here. Across devices (legal on CUDA: the tensor moves to ``value``'s
    device, keeping its identity, ``requires_grad`` and attributes) the Python object takes a
    new tensor of ``value``'s kind in place (``torch.utils.swap_tensors``), since a host tensor
    cannot become a wrapper subclass by a metadata swap."""
    if isinstance(tensor, StrictTensor) and isinstance(value, StrictTensor):
        with torch._C.DisableTorchFunctionSubclass():
            _DATA_ATTR.__set__(tensor, value)
        tensor.elem = value.elem
        return
    attrs = {k: v for k, v in tensor.__dict__.items() if k not in ("elem", "_is_param")}
    is_param = isinstance(tensor, torch.nn.Parameter)
    if isinstance(value, StrictTensor):
        moved = StrictTensor(value.elem)
        if is_param:
            moved._is_param = True
    else:
        plain = value.detach()
        moved = torch.nn.Parameter(plain) if is_param else plain
    moved.requires_grad_(tensor.requires_grad)
    moved.__dict__.update(attrs)
    torch.utils.swap_tensors(tensor, moved)


class _CrossDeviceData(torch.overrides.TorchFunctionMode):
    """Routes ``host_tensor.data = strict_tensor`` to :func:`_set_data` (a host tensor's own
    ``__torch_function__`` is torch's, so only a mode sees that assignment). Pushed once per
    process; passes everything through when no :class:`StrictDevice` is active."""

    active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            self.active
            and getattr(func, "__self__", None) is _DATA_ATTR
            and func.__name__ == "__set__"
            and not isinstance(args[0], StrictTensor)
            and isinstance(args[1], StrictTensor)
        ):
            return _set_data(*args)
        return func(*args, **(kwargs or {}))


_CROSS_DEVICE_DATA: _CrossDeviceData | None = None


def _to_numpy(tensor: StrictTensor, *args, **kwargs):
    raise TypeError(
        f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to "
        f"copy the tensor to host memory first."
    )


_ON_ELEM = {  # methods answered by the CPU tensor behind the wrapper
    torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage,
    torch.Tensor.storage,
    torch.Tensor._typed_storage,
    torch.Tensor.tolist,
}
_OVERRIDES: dict[Callable, Callable] = {
    torch.Tensor.numpy: _to_numpy,
    torch.Tensor.__array__: _to_numpy,
}


def _function_override(func) -> Callable | None:
    if getattr(func, "__self__", None) is _DATA_ATTR and func.__name__ == "__set__":
        return _set_data
    if func in _ON_ELEM:
        return lambda self, *a, **k: getattr(self.elem, func.__name__)(*a, **k)
    return _OVERRIDES.get(func)


# -- the backend: factories and cross-device copies ----------------------------------------------


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    memory_format = memory_format or torch.contiguous_format
    return StrictTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return StrictTensor(torch.empty_strided(size, stride, dtype=dtype))


def _copy_from(src, dst, non_blocking=False):
    (dst.elem if isinstance(dst, StrictTensor) else dst).copy_(
        src.elem if isinstance(src, StrictTensor) else src
    )
    return dst


def _copy_from_and_resize(src, dst):
    target = dst.elem if isinstance(dst, StrictTensor) else dst
    target.resize_(src.shape)
    return _copy_from(src, dst)


def _local_scalar_dense(tensor):
    # ``torch.tensor([strict 0-dim, ...])`` reads each value with the Python key excluded.
    return tensor.elem.item()


_LIBRARY: torch.library.Library | None = None


def install() -> None:
    """Register the ``strict`` device with torch (once per process; idempotent).

    Raises:
        RuntimeError: another PrivateUse1 backend was registered in this process.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    name = torch._C._get_privateuse1_backend_name()
    if name != DEVICE_TYPE:
        if name != "privateuseone":
            raise RuntimeError(f"PrivateUse1 is already the {name!r} backend in this process")
        _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE)
    library = torch.library.Library("aten", "IMPL")
    library.impl("empty.memory_format", _empty, "PrivateUse1")
    library.impl("empty_strided", _empty_strided, "PrivateUse1")
    library.impl("_copy_from", _copy_from, "PrivateUse1")
    library.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    library.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
    _LIBRARY = library


# -- collectives ---------------------------------------------------------------------------------


def _not_the_rng_notice(record) -> bool:
    # megatron-core's GPU branch initialises weights inside its CUDA RNG fork and warns when the
    # CPU generator moved meanwhile; here (compat.cuda_on_cpu) the CUDA generator *is* the CPU's.
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


class StrictDevice:
    """Run the engine on ``strict:0`` while active (see the module docstring).

    Enter inside a rank before the engine sets up its device (``initialize_distributed``);
    leaving restores ``torch.distributed`` and the engine's gloo device.

    Attributes:
        host_groups: process groups created with an explicit ``backend="gloo"``; they accept
            host tensors (as on a GPU run).
    """

    def __init__(self):
        self.host_groups: list = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _group_of(self, original, args, kwargs):
        try:
            bound = inspect.signature(original).bind(*args, **kwargs)
        except TypeError:
            return None
        return bound.arguments.get("group")

    def _collective(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def run(*args, **kwargs):
            group = self._group_of(original, args, kwargs)
            if not any(group is g for g in self.host_groups):
                host = [
                    t
                    for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor) and not isinstance(t, StrictTensor)
                ]
                if host:
                    shapes = ", ".join(str(tuple(t.shape)) for t in host)
                    raise StrictDeviceError(
                        f"torch.distributed.{name} was given host tensor(s) of shape {shapes}: "
                        f"NCCL takes device tensors only (tests/strict_device.py)"
                    )
            args, kwargs = tree_map(
                lambda x: x.elem if isinstance(x, StrictTensor) else x, (args, kwargs)
            )
            return original(*args, **kwargs)

        return run

    def _object_collective(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def run(*args, **kwargs):
            group = self._group_of(original, args, kwargs)
            device = kwargs.get("device")
            if (
                device is not None
                and torch.device(device).type == "cpu"
                and not any(group is g for g in self.host_groups)
            ):
                raise StrictDeviceError(
                    f"torch.distributed.{name} was told device={device}: NCCL stages objects "
                    f"in device tensors only (tests/strict_device.py)"
                )
            return original(*args, **kwargs)

        return run

    def _new_group(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def run(*args, **kwargs):
            group = original(*args, **kwargs)
            try:
                backend = inspect.signature(original).bind(*args, **kwargs).arguments.get("backend")
            except TypeError:
                backend = None
            if backend is not None and str(backend).lower() == "gloo":
                self.host_groups.append(group)
            return group

        return run

    def __enter__(self) -> StrictDevice:
        global _CROSS_DEVICE_DATA
        install()
        if _CROSS_DEVICE_DATA is None:
            # Stays pushed: megatron-core's CPU redirection pushes its mode above it later, and
            # a mode can only leave the top of the stack.
            _CROSS_DEVICE_DATA = _CrossDeviceData()
            _CROSS_DEVICE_DATA.__enter__()
        _CROSS_DEVICE_DATA.active = True
        from dpo_megatron.parallel import device

        device.set_gloo_device(DEVICE)
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_not_the_rng_notice)
        for name in _COLLECTIVES:
            original = getattr(dist, name)
            self._saved.append((dist, name, original))
            setattr(dist, name, self._collective(name, original))
        for name in _OBJECT_COLLECTIVES:
            original = getattr(dist, name)
            self._saved.append((dist, name, original))
            setattr(dist, name, self._object_collective(name, original))
        self._saved.append((dist, "new_group", dist.new_group))
        dist.new_group = self._new_group(dist.new_group)
        return self

    def __exit__(self, *exc) -> None:
        from dpo_megatron.compat import cuda_on_cpu
        from dpo_megatron.parallel import device

        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        device.set_gloo_device(None)
        if cuda_on_cpu.is_enabled():  # megatron-core's CUDA requests: back to the host
            cuda_on_cpu.enable(device.CPU_DEVICE)
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_not_the_rng_notice)
        if _CROSS_DEVICE_DATA is not None:
            _CROSS_DEVICE_DATA.active = False


def is_strict(tensor: torch.Tensor) -> bool:
    """True for a tensor on ``strict:0``."""
    return isinstance(tensor, StrictTensor)
