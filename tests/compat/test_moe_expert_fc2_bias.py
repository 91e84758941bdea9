"""compat.moe_expert_fc2_bias: megatron-core 0.16's expert MLP adds its fc2 bias in place to
the output of a reduce over a group of one, an autograd error while training, and marks the bias
sequence-parallel; with the patch the output and gradients are those of ``x W^T + p b`` (by
hand) and an expert's bias is unmarked (a dense layer's stays marked). The gradients the mark
got wrong at TP 2 x EP 2 are checked against one rank in ``training/test_moe_dpo``."""

import subprocess
import sys

SCRIPT = """
import torch
from dpo_megatron.parallel import ParallelConfig, initialize_distributed
initialize_distributed(ParallelConfig())  # one rank: expert groups of one
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

config = TransformerConfig(
    num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True
)

def row_linear(is_expert):
    return RowParallelLinear(
        6, 8, config=config, init_method=torch.nn.init.normal_, bias=True,
        input_is_parallel=True, skip_bias_add=True, is_expert=is_expert,
    )

config.sequence_parallel = True  # as under TP 2 (the mark is set at construction)
assert row_linear(True).bias.sequence_parallel
assert not getattr(row_linear(True).bias, "tensor_model_parallel", False)
config.sequence_parallel = False
fc2 = row_linear(True)
with torch.no_grad():
    fc2.bias.normal_()
x = torch.randn(5, 6, requires_grad=True)
p = torch.rand(5)

def expert_output():  # the tail of megatron-core's MLP.forward with routing probabilities
    output, output_bias = fc2(x)
    output += output_bias.unsqueeze(0) * p.unsqueeze(-1)
    return output

try:
    expert_output()
    print("no fault")
except RuntimeError as e:
    print("RuntimeError", str(e).splitlines()[0])
from dpo_megatron.compat import moe_expert_fc2_bias
assert moe_expert_fc2_bias.enable() and moe_expert_fc2_bias.enable()
config.sequence_parallel = True
assert not row_linear(True).bias.sequence_parallel and row_linear(False).bias.sequence_parallel
config.sequence_parallel = False
assert row_linear(True).bias.tensor_model_parallel  # counted once per expert in the grad norm
assert not getattr(row_linear(False).bias, "tensor_model_parallel", False)
out = expert_output()
out.square().sum().backward()
xr = x.detach().requires_grad_()
w, b = fc2.weight.detach().requires_grad_(), fc2.bias.detach().requires_grad_()
want = xr @ w.t() + p[:, None] * b
want.square().sum().backward()
assert torch.allclose(out, want)
assert torch.allclose(x.grad, xr.grad) and torch.allclose(fc2.bias.grad, b.grad)
assert torch.allclose(fc2.weight.grad, w.grad)
print("patched ok")
"""


def test_expert_bias_add_fails_without_the_patch_and_trains_with_it():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("RuntimeError") and "modified inplace" in lines[0], lines
    assert lines[-1] == "patched ok"
