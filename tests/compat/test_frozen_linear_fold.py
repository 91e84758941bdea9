"""compat.frozen_linear_fold: megatron-core's column- and row-parallel linears give a frozen
weight (a DPO reference) the same output bits as a trainable one (the policy) on the inputs a
one-row packed micro-batch makes (strides (h, s * h, 1)) and on a non-contiguous input; without
the patch the frozen one runs torch.matmul's batched kernel on the one-row input and differs.
The trainable path's output is the same before and after the patch. The engine-wide result
(step-0 policy log-probs equal to the reference's at every layout) is checked in
``tests/training``."""

import subprocess
import sys

SCRIPT = """
import torch
from dpo_megatron.parallel import ParallelConfig, initialize_distributed
initialize_distributed(ParallelConfig())
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

torch.manual_seed(0)
config = TransformerConfig(
    num_layers=1, hidden_size=64, num_attention_heads=1, use_cpu_initialization=True
)
kw = dict(config=config, init_method=torch.nn.init.normal_, bias=False)
builds = [
    lambda: ColumnParallelLinear(64, 96, gather_output=False, **kw),
    lambda: RowParallelLinear(64, 96, input_is_parallel=True, skip_bias_add=True, **kw),
]
pairs = []
for build in builds:
    trainable, frozen = build(), build()
    frozen.weight.requires_grad_(False)
    frozen.weight.data.copy_(trainable.weight.data)
    pairs.append((trainable, frozen))
one_row = torch.randn(1, 37, 64).transpose(0, 1).contiguous()  # [s, 1, h], strides (h, s*h, 1)
strided = torch.randn(3, 37, 64).transpose(0, 1)  # [s, 3, h], not contiguous
assert one_row.stride() == (64, 37 * 64, 1) and not strided.is_contiguous()

def outputs():
    with torch.no_grad():
        return [[m(x)[0] for m in pair] for pair in pairs for x in (one_row, strided)]

before = outputs()
print("one-row frozen == trainable before:", all(torch.equal(*o) for o in before[0::2]))
from dpo_megatron.compat import frozen_linear_fold
assert frozen_linear_fold.enable() and frozen_linear_fold.enable()
after = outputs()
for (trainable_before, _), (trainable, frozen) in zip(before, after):
    assert torch.equal(trainable, trainable_before)  # the trainable path is untouched
    assert torch.equal(frozen, trainable)
print("patched ok")
"""


def test_a_frozen_linear_gives_the_trainable_linears_bits_only_with_the_patch():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "one-row frozen == trainable before: False", lines
    assert lines[-1] == "patched ok"
