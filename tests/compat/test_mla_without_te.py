"""compat.mla_without_te: megatron-core 0.16's multi-latent attention raises TypeError at
construction without transformer-engine; with the patch a local-spec MLA layer (the engine's core
attention) builds and runs."""

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="the fault only exists without transformer-engine",
)

SCRIPT = """
import os, torch
from dpo_megatron.compat import cuda_on_cpu
cuda_on_cpu.enable()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29531")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
    q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
    rope_type="rope", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
attention = spec.submodules.self_attention
# megatron-core's own local core attention takes no MLA head sizes: the engine's does.
from dpo_megatron.models.attention import core_attention_spec
attention.submodules.core_attention = core_attention_spec("sdpa", transformer_engine=False)
try:
    build_module(attention, config=config, layer_number=1)
    print("no fault")
except TypeError as e:
    print("TypeError", e)
from dpo_megatron.compat import mla_without_te
assert mla_without_te.enable() and mla_without_te.enable()
layer = build_module(attention, config=config, layer_number=1)
out, _ = layer(torch.randn(5, 2, 32), None)
assert out.shape == (5, 2, 32) and torch.isfinite(out).all()
print("patched ok")
"""


def test_mla_fails_to_build_without_the_patch_and_builds_with_it():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("TypeError") and "isinstance" in lines[0], lines
    assert lines[-1] == "patched ok"
