"""Tell host tensors from device tensors on a machine where both are the CPU.

On a GPU a tensor left on the host fails loudly: a CUDA kernel or an NCCL collective refuses it.
On the CPU (gloo) host and device are the same memory, so nothing fails and no test would notice.
:class:`HostTensorCheck` makes the difference visible:

* the engine's device becomes ``cpu:0`` (``dpo_megatron.parallel.device.set_gloo_device``):
  the same memory, but a name that factory calls and ``Tensor.to`` record;
* every tensor is tagged: **device** when made with ``device=`` the engine's device or CUDA,
  moved there with ``.to`` / ``.cuda()`` (the host -> device boundary), or computed from a device
  tensor; **host** when made by a factory with no device (or a plain ``cpu``), moved with
  ``.cpu()``, or computed from host tensors only. A parameter takes the tag of the tensor it was
  made from (``nn.Parameter(torch.ones(h))`` is a host parameter until a ``.to`` / ``.data =``
  moves it), so a model left on the host is seen like any other host tensor; only parameters
  made before the check started count as device;
* ``Tensor.device`` of a device tensor answers ``cpu:0``, so code that places new tensors by an
  existing one's device behaves as it would on a GPU.

A violation is what CUDA or NCCL would reject:

* an op that mixes a device tensor with a host tensor, except a 0-dim host tensor in an
  elementwise op (a CPU scalar, which CUDA accepts), copies and moves (``copy_``, ``to``) and
  host index tensors (``t[idx]``);
* a ``torch.distributed`` collective or point-to-point call given a host tensor;
* a model forward given a host tensor.

Usage (inside a rank, before anything is built)::

    with HostTensorCheck() as check:
        ...  # build the trainer, take steps
    assert not check.violations, check.report()
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

HOST, DEVICE = "host", "device"
ENGINE_DEVICE = torch.device("cpu", 0)

_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.tril_indices,
    torch.triu_indices,
    torch.from_numpy,
    torch.frombuffer,
}
_LIKE = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
}
_NEW = {
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_empty,
    torch.Tensor.new_full,
    torch.Tensor.new_tensor,
}
# Ops that CUDA runs across devices, or whose extra tensors are indices it moves itself.
_CROSSING = {
    torch.Tensor.copy_,
    torch.Tensor.to,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.__getitem__,
    torch.Tensor.pin_memory,
    torch._has_compatible_shallow_copy_type,
}  # Module.to asks it before ``.data =``
# Joining ops: every input must be on one device, 0-dim or not.
_JOINING = {torch.cat, torch.stack, torch.concat, torch.concatenate, torch.hstack, torch.vstack}
_DEVICE_ATTR = torch._C.TensorBase.device
_DATA_ATTR = torch._C.TensorBase.data
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
# Collectives of Python objects pickle into a tensor on their ``device`` argument: told a host
# device on a GPU run, NCCL refuses it.
_OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
)


def _is_device_name(device: Any) -> bool | None:
    """True for the engine's device or CUDA, False for a plain host device, None if absent."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    device = torch.device(device) if isinstance(device, str) else device
    if not isinstance(device, torch.device):
        return None
    return device.type == "cuda" or device == ENGINE_DEVICE


class HostTensorCheck(TorchFunctionMode):
    """Records every host/device mix-up while active (see the module docstring).

    Attributes:
        violations: (what, where) pairs: a description and the innermost engine frame.
    """

    def __init__(self):
        super().__init__()
        self.where = WeakIdKeyDictionary()
        self.violations: list[tuple[str, str]] = []
        self._saved: list = []

    # -- tags -----------------------------------------------------------------------------------

    def kind(self, t: torch.Tensor) -> str | None:
        tag = self.where.get(t)
        if tag is None and isinstance(t, torch.nn.Parameter):
            return DEVICE
        return tag

    def _tag(self, out: Any, kind: str | None) -> None:
        if kind is None:
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.where[t] = kind

    def _record(self, what: str) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-2]
            if "dpo_megatron" in f.filename or "megatron/core" in f.filename
        ]
        where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else "?"
        self.violations.append((what, where))

    def report(self) -> str:
        return "\n".join(f"{what} at {where}" for what, where in self.violations)

    # -- torch functions ------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        descriptor = getattr(func, "__self__", None)
        if descriptor is _DEVICE_ATTR and func.__name__ == "__get__":
            device = func(*args, **kwargs)
            return ENGINE_DEVICE if self.kind(args[0]) == DEVICE else device
        if descriptor is _DATA_ATTR and func.__name__ == "__set__":
            # ``t.data = other``: t now holds other's memory (legal across devices).
            out = func(*args, **kwargs)
            self._tag(args[0], self.kind(args[1]))
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        kinds = {self.kind(t) for t in inputs}
        self._check_mix(func, args, inputs)
        out = func(*args, **kwargs)
        if not isinstance(out, (torch.Tensor, tuple, list)):
            return out
        self._tag(out, self._output_kind(func, args, kwargs, kinds))
        return out

    def _check_mix(self, func, args, inputs) -> None:
        if func in _CROSSING:
            return
        if func is torch.Tensor.__setitem__:  # index tensors may live anywhere
            inputs = [t for t in (args[0], args[2]) if isinstance(t, torch.Tensor)]
        device = [t for t in inputs if self.kind(t) == DEVICE]
        host = [t for t in inputs if self.kind(t) == HOST and (t.dim() > 0 or func in _JOINING)]
        if device and host:
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            self._record(
                f"{name} mixes device tensors with host tensor(s) of shape "
                f"{[tuple(t.shape) for t in host]}"
            )

    def _output_kind(self, func, args, kwargs, kinds) -> str | None:
        if func in _FACTORIES or func in _NEW:
            named = _is_device_name(kwargs.get("device"))
            if named is None and func in _NEW:
                return self.kind(args[0])
            return DEVICE if named else HOST
        if func in _LIKE:
            named = _is_device_name(kwargs.get("device"))
            return self.kind(args[0]) if named is None else (DEVICE if named else HOST)
        if func is torch.Tensor.cuda:
            return DEVICE
        if func is torch.Tensor.cpu:
            return HOST
        if func is torch.Tensor.to:
            target = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                    target = a
                elif isinstance(a, torch.Tensor):
                    return self.kind(a)
            named = _is_device_name(target)
            return self.kind(args[0]) if named is None else (DEVICE if named else HOST)
        if DEVICE in kinds:
            return DEVICE
        return HOST if HOST in kinds else None

    # -- collectives and model inputs ------------------------------------------------------------

    def _wrap_collective(self, name: str):
        original = getattr(dist, name)

        def checked(*args, **kwargs):
            for t in tree_flatten((args, kwargs))[0]:
                tensors = (
                    [t] if isinstance(t, torch.Tensor) else [getattr(t, "tensor", None)]
                )  # P2POp of batch_isend_irecv
                for x in tensors:
                    if isinstance(x, torch.Tensor) and self.kind(x) == HOST:
                        self._record(
                            f"torch.distributed.{name} given a host tensor of shape "
                            f"{tuple(x.shape)}"
                        )
            return original(*args, **kwargs)

        return original, checked

    def _wrap_object_collective(self, name: str):
        original = getattr(dist, name)

        def checked(*args, **kwargs):
            if _is_device_name(kwargs.get("device")) is False:
                self._record(f"torch.distributed.{name} told device={kwargs['device']} (host)")
            return original(*args, **kwargs)

        return original, checked

    def _check_model_inputs(self, module, args, kwargs):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and self.kind(t) == HOST:
                self._record(
                    f"{type(module).__name__}.forward given a host tensor of shape {tuple(t.shape)}"
                )

    def __enter__(self):
        import megatron.core.tensor_parallel.random  # noqa: F401  (before the RNG patch)

        from dpo_megatron.compat import cuda_on_cpu
        from dpo_megatron.models.gpt import ScoringGPTModel
        from dpo_megatron.parallel import device

        # The engine's device, and where megatron-core's CUDA requests land: ``cpu:0``.
        device.set_gloo_device(ENGINE_DEVICE)
        cuda_on_cpu.enable(ENGINE_DEVICE)
        self._saved = [(torch.nn.Parameter, "__new__", staticmethod(torch.nn.Parameter.__new__))]
        make_parameter = torch.nn.Parameter.__new__
        check = self

        def tagged_parameter(cls, data=None, requires_grad=True):
            param = make_parameter(cls, data, requires_grad)
            if data is not None:
                check._tag(param, check.where.get(data))
            return param

        torch.nn.Parameter.__new__ = staticmethod(tagged_parameter)
        for name in _OBJECT_COLLECTIVES:
            original, checked = self._wrap_object_collective(name)
            self._saved.append((dist, name, original))
            setattr(dist, name, checked)
        for name in _COLLECTIVES:
            original, checked = self._wrap_collective(name)
            self._saved.append((dist, name, original))
            setattr(dist, name, checked)
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: (
                self._check_model_inputs(m, a, {}) if isinstance(m, ScoringGPTModel) else None
            )
        )
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        from dpo_megatron.compat import cuda_on_cpu
        from dpo_megatron.parallel import device

        device.set_gloo_device(None)
        cuda_on_cpu.enable(device.CPU_DEVICE)
        return super().__exit__(*exc)


def assert_no_host_tensors(check: HostTensorCheck, what: Iterable[str] = ()) -> None:
    """Fail with the check's report when it saw any violation."""
    assert not check.violations, "host tensors reached the device:\n" + check.report()
