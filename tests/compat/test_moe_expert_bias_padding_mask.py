"""compat.moe_expert_bias_padding_mask: megatron-core 0.16's expert-bias token count fails with a
padding mask; with the patch it counts the routed real tokens per expert (hand-checked)."""

import subprocess
import sys

SCRIPT = """
import torch
from megatron.core.transformer.moe.router import TopKRouter

class Router:  # the attributes the method reads
    enable_expert_bias = True
    local_tokens_per_expert = torch.zeros(3)

routing_map = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.bool)
padding = torch.tensor([False, False, True, False])  # token 2 is padding
try:
    TopKRouter._apply_expert_bias.__wrapped__(Router(), routing_map, padding)
    print("no fault")
except RuntimeError as e:
    print("RuntimeError", str(e).splitlines()[0])
from dpo_megatron.compat import moe_expert_bias_padding_mask
assert moe_expert_bias_padding_mask.enable() and moe_expert_bias_padding_mask.enable()
router = Router()
router.local_tokens_per_expert = torch.zeros(3)
TopKRouter._apply_expert_bias(router, routing_map, padding)
assert router.local_tokens_per_expert.tolist() == [2, 3, 1], router.local_tokens_per_expert
with torch.no_grad():  # evaluation: nothing counted
    TopKRouter._apply_expert_bias(router, routing_map, padding)
assert router.local_tokens_per_expert.tolist() == [2, 3, 1]
print("patched ok")
"""


def test_expert_bias_count_fails_with_a_padding_mask_without_the_patch_and_counts_with_it():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("RuntimeError") and "size of tensor" in lines[0], lines
    assert lines[-1] == "patched ok"
