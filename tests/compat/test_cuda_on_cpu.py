"""compat.cuda_on_cpu: CUDA requests land on the CPU; the device owner switches it on only for
the CPU device (gloo), never for NCCL."""

import subprocess
import sys

import pytest
import torch

from dpo_megatron.compat import cuda_on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


@pytest.fixture(scope="module", autouse=True)
def _enabled():
    assert cuda_on_cpu.enable() is True
    assert cuda_on_cpu.enable() is True  # idempotent
    assert cuda_on_cpu.is_enabled()


def test_cuda_devices_become_cpu():
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert torch.zeros(3, device="cuda:1").device.type == "cpu"
    assert torch.ones(1, device=torch.device("cuda")).device.type == "cpu"
    assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
    x = torch.arange(4.0)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to(device="cuda", dtype=torch.float64).dtype == torch.float64


def test_suspended_blocks_bypass_the_mode_and_nest():
    """Inside ``suspended()`` torch calls skip the mode (a CUDA literal is no longer redirected;
    ``current_device()`` still answers the CPU), and the mode is back on leaving the block,
    also from a nested one."""
    with cuda_on_cpu.suspended():
        assert torch.overrides._get_current_function_mode() is None
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(1, device="cuda")
        with cuda_on_cpu.suspended():  # nothing of ours to pop: a no-op
            assert torch.overrides._get_current_function_mode() is None
        assert torch.overrides._get_current_function_mode() is None
    assert torch.empty(1, device="cuda").device.type == "cpu"


def test_tensor_type_names_match_megatron_checks():
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"
    # Conversion through .type(dtype) still converts.
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64


def test_model_parallel_rng_tracker_forks_on_cpu_generator():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(
        123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
    )
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outside_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    # The fork restores the default generator: the outside stream is untouched.
    assert torch.equal(torch.get_rng_state(), outside_before)
    tensor_parallel.model_parallel_cuda_manual_seed(
        123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
    )
    with tensor_parallel.get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    assert torch.equal(a, b)


def test_megatron_buffer_allocation_in_backward_of_tp_linear():
    """Regression: backward of TP layers allocates with device=current_device() outside modes."""
    from tests.multirank import run_ranks

    assert run_ranks(_tp_linear_backward, world_size=1) == [(4, 8)]


def _tp_linear_backward():
    from megatron.core import tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    initialize_distributed(ParallelConfig())
    set_seed(0)
    layer = tensor_parallel.ColumnParallelLinear(
        8,
        4,
        config=ModelParallelConfig(use_cpu_initialization=True),
        init_method=torch.nn.init.normal_,
        bias=False,
    )
    x = torch.randn(3, 2, 8, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    return tuple(layer.weight.grad.shape)


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_FAKE_CUDA = (
    "import torch\n"
    "torch.cuda.is_available = lambda: True\n"
    "torch.cuda.set_device = lambda device: None\n"
    "before = torch.cuda.current_device\n"
    "from dpo_megatron.compat import cuda_on_cpu\n"
    "from dpo_megatron.parallel import device\n"
)


def test_nccl_on_a_cuda_machine_leaves_megatron_untouched():
    assert (
        _run(
            _FAKE_CUDA
            + (
                "assert device.resolve_backend('auto') == 'nccl'\n"
                "assert device.setup_device('nccl') == torch.device('cuda', 0)\n"
                "assert device.backend() == 'nccl' and device.is_cuda()\n"
                "assert not cuda_on_cpu.is_enabled()\n"
                "assert torch.cuda.current_device is before\n"
                "assert torch.zeros(1).type() == 'torch.FloatTensor'\n"
                "print('ok')\n"
            )
        )
        == "ok"
    )


def test_gloo_forced_on_a_cuda_machine_runs_on_the_cpu():
    assert (
        _run(
            _FAKE_CUDA
            + (
                "assert device.setup_device('gloo') == torch.device('cpu')\n"
                "assert device.backend() == 'gloo' and not device.is_cuda()\n"
                "assert cuda_on_cpu.is_enabled()\n"
                "assert torch.empty(1, device='cuda').device.type == 'cpu'\n"
                "print('ok')\n"
            )
        )
        == "ok"
    )


def test_the_patch_is_declared_for_the_versions_it_was_tested_on():
    assert cuda_on_cpu.PATCH.versions["megatron-core"] == ">=0.16.0,<0.17"
    assert not cuda_on_cpu.PATCH.off_on_other_versions  # a CPU run cannot do without it
    assert cuda_on_cpu.PATCH.mismatches() == {}  # this environment is the tested one


def test_the_redirection_lands_on_the_gloo_device_a_test_chose():
    """``parallel.device.set_gloo_device`` (the seam of ``tests/strict_device.py``): the engine's
    device, megatron-core's CUDA requests and its weight initialisation follow it."""
    assert (
        _run(
            "import torch\n"
            "from dpo_megatron.models import ModelConfig\n"
            "from dpo_megatron.models.transformer_config import build_transformer_config\n"
            "from dpo_megatron.parallel import ParallelConfig, device\n"
            "try:\n"
            "    device.set_gloo_device('cuda:0')\n"
            "except ValueError as e:\n"
            "    assert 'parallel.backend=nccl' in str(e)\n"
            "else:\n"
            "    raise AssertionError('cuda accepted as a gloo device')\n"
            "def on_host_init():\n"
            "    config = build_transformer_config(ModelConfig(), ParallelConfig())\n"
            "    return config.use_cpu_initialization\n"
            "assert on_host_init()\n"
            "device.set_gloo_device('meta')\n"
            "assert device.setup_device('gloo') == torch.device('meta') == device.get_device()\n"
            "assert not device.is_host() and not device.is_cuda()\n"
            "assert torch.cuda.current_device() == 'meta'\n"
            "assert torch.empty(2, device='cuda').device.type == 'meta'\n"
            "assert torch.zeros(2).cuda().device.type == 'meta'\n"
            "assert torch.zeros(2).to('cuda:1').device.type == 'meta'\n"
            "assert not on_host_init()  # megatron-core's GPU branch: weights made on the device\n"
            "print('ok')\n"
        )
        == "ok"
    )
