"""The CUDA allocator default of ``parallel.device``: expandable segments unless the user chose
the allocator's settings, set before CUDA initialises."""

import os
import subprocess
import sys

import pytest
import torch

from dpo_megatron.parallel.device import CUDA_ALLOCATOR_DEFAULT, default_cuda_allocator


def test_default_only_when_the_user_set_nothing():
    env = {}
    assert default_cuda_allocator(env) == "expandable_segments:True" == CUDA_ALLOCATOR_DEFAULT
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for value in ("max_split_size_mb:256", ""):  # the user's own, even empty, is kept
            env = {name: value}
            assert default_cuda_allocator(env) is None
            assert env == {name: value}


_SETUP_NCCL = (  # setup_device('nccl') on a machine that pretends to have CUDA
    "import os, torch\n"
    "torch.cuda.is_available = lambda: True\n"
    "seen = []\n"
    "torch.cuda.set_device = lambda device: "
    "seen.append(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
    "from dpo_megatron.parallel import device\n"
    "device.setup_device('nccl')\n"
    "print(seen)\n"
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pretends to have CUDA")
@pytest.mark.parametrize(
    "user, seen",
    [
        (None, "['expandable_segments:True']"),
        ("expandable_segments:False", "['expandable_segments:False']"),
    ],
)
def test_nccl_sets_the_default_before_the_first_cuda_call(user, seen):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    }
    if user is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user
    out = subprocess.run(
        [sys.executable, "-c", _SETUP_NCCL], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == seen
