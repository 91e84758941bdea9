"""tests/strict_device.py: ``strict:0`` refuses what CUDA and NCCL refuse, accepts what they
accept, and computes the CPU's values.

Every check runs in one rank process: installing the backend is for the life of a process, so
it never happens in the pytest process itself.
"""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow


def _refused(fn) -> str:
    """The StrictDeviceError message of ``fn()``, or '' when it ran."""
    from tests.strict_device import StrictDeviceError

    try:
        fn()
    except StrictDeviceError as e:
        return str(e)
    return ""


def _observe() -> dict:
    import torch

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed
    from dpo_megatron.parallel.device import get_device
    from tests.strict_device import DEVICE, StrictDevice, is_strict

    host = torch.arange(6.0).reshape(2, 3)
    out = {}
    with StrictDevice():
        initialize_distributed(ParallelConfig())  # the engine's set-up: its device is strict
        out["engine device"] = str(get_device())
        out["megatron's cuda"] = is_strict(torch.empty(2, device=torch.cuda.current_device()))
        dev = host.to(DEVICE)
        # mixing: refused unless the host side is a 0-dim scalar, a copy or a host index list
        out["add host"] = _refused(lambda: dev + host)
        out["matmul host"] = _refused(lambda: dev @ host.T)
        out["cat host"] = _refused(lambda: torch.cat([dev, host]))
        out["index a host tensor by device ids"] = _refused(
            lambda: host[torch.tensor([1], device=DEVICE)]
        )
        out["add scalar"] = (dev + torch.tensor(2.0)).cpu().tolist()
        out["host index"] = dev[torch.tensor([1, 0])].cpu().tolist()
        put = dev.clone()
        put[torch.tensor([0])] = torch.full((1, 3), 7.0, device=DEVICE)
        out["host index put"] = put.cpu().tolist()
        back = torch.zeros(2, 3)
        back.copy_(dev * 2)
        out["copy to host"] = (type(back) is torch.Tensor, back.tolist())
        out["moves"] = [
            is_strict(t)
            for t in (
                dev.cpu(),
                dev.to("cpu"),
                dev.to(torch.float64),
                torch.zeros(2, device=DEVICE),
                torch.tensor([1, 2], device=DEVICE),
                torch.ones_like(host, device=DEVICE),
                dev.new_zeros(3),
                torch.arange(3, device=DEVICE),
                dev.sum(),
            )
        ]
        out["item"] = dev.sum().item()
        # a module moved to the device computes the CPU's values and gradients
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2)
        on_device = torch.nn.Linear(3, 2).to(DEVICE)
        on_device.load_state_dict(layer.state_dict())
        layer(host).square().sum().backward()
        on_device(dev).square().sum().backward()
        out["module"] = (
            is_strict(on_device.weight),
            is_strict(on_device.weight.grad),
            torch.equal(on_device.weight.grad.cpu(), layer.weight.grad),
        )
        out["module given host input"] = _refused(lambda: on_device(host))
        # host.data = device tensor moves the parameter, as on CUDA (megatron-core's DDP)
        param = torch.nn.Parameter(torch.ones(3))
        param.sequence_parallel = True
        buffer = torch.zeros(5, device=DEVICE)
        alias = param
        param.data = buffer[1:4]
        buffer.add_(1.0)
        out["moved by .data"] = (
            alias is param,
            is_strict(param),
            isinstance(param, torch.nn.Parameter),
            param.requires_grad,
            param.sequence_parallel,
            param.cpu().tolist(),
        )
        out["numpy"] = ""
        try:
            dev.numpy()
        except TypeError as e:
            out["numpy"] = str(e)
        # collectives: device tensors in place; host tensors refused except on gloo groups
        summed = torch.ones(2, device=DEVICE)
        torch.distributed.all_reduce(summed)
        out["all_reduce"] = (is_strict(summed), summed.cpu().tolist())
        out["all_reduce host"] = _refused(lambda: torch.distributed.all_reduce(torch.ones(2)))
        gloo = torch.distributed.new_group([0], backend="gloo")
        host_sum = torch.ones(2)
        torch.distributed.all_reduce(host_sum, group=gloo)
        out["all_reduce host on a gloo group"] = host_sum.tolist()
    return out


@pytest.fixture(scope="module")
def seen():
    return run_ranks(_observe, world_size=1)[0]


def test_the_engine_and_megatron_core_compute_on_the_strict_device(seen):
    assert seen["engine device"] == "strict:0"
    assert seen["megatron's cuda"]


@pytest.mark.parametrize(
    "what",
    [
        "add host",
        "matmul host",
        "cat host",
        "index a host tensor by device ids",
        "module given host input",
        "all_reduce host",
    ],
)
def test_what_cuda_or_nccl_refuses_is_refused(seen, what):
    assert seen[what].startswith(
        (
            "Expected all tensors to be on the same device, but found at "
            "least two devices, strict:0 and cpu!",
            "torch.distributed.all_reduce was given host tensor(s)",
        )
    ), seen[what]


def test_what_cuda_accepts_runs_with_the_cpu_values(seen):
    assert seen["add scalar"] == [[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]]
    assert seen["host index"] == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0]]
    assert seen["host index put"] == [[7.0, 7.0, 7.0], [3.0, 4.0, 5.0]]
    assert seen["copy to host"] == (True, [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]])
    assert seen["moves"] == [False, False, True, True, True, True, True, True, True]
    assert seen["item"] == 15.0
    assert seen["module"] == (True, True, True)
    assert seen["numpy"].startswith("can't convert strict:0 device type tensor to numpy")


def test_assigning_device_data_moves_a_host_parameter_in_place(seen):
    assert seen["moved by .data"] == (True, True, True, True, True, [1.0, 1.0, 1.0])


def test_collectives_run_in_place_and_gloo_groups_take_host_tensors(seen):
    assert seen["all_reduce"] == (True, [1.0, 1.0])
    assert seen["all_reduce host on a gloo group"] == [1.0, 1.0]
