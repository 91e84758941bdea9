"""LoRA export: the adapters in PEFT's layout load with ``peft.PeftModel.from_pretrained`` onto the
HF base and give the engine's log-probs; the merged HF folder holds base + (alpha / r) B A.

Each case loads a tiny random HF model into the engine at a TP x PP layout, attaches adapters
with random B (so they change the model), computes log-probs through the pipeline, and exports
both ways; the checks run in the test process with transformers + peft.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models.conversion_helpers import (
    build_tiny_hf_model,
    imported_chunks,
    pipeline_logits,
    save_tiny_hf_folder,
    token_logps,
)
from tests.multirank import run_ranks

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0


def _engine_export(hf_dir, tp, pp, input_ids, adapter_dir, merged_dir, targets):
    from megatron.core import parallel_state as ps

    from dpo_megatron.models import export_hf
    from dpo_megatron.models.conversion import export_peft_adapter
    from dpo_megatron.models.lora import attach_lora, reset_adapters
    from dpo_megatron.models.lora_config import LoraConfig

    chunks, cfg = imported_chunks(hf_dir, tp, pp)
    lora = LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, target_modules=targets)
    attach_lora(chunks, lora, cfg, seed=3)
    reset_adapters(chunks, seed=3, b_std=0.1)
    logits = pipeline_logits(chunks, input_ids)
    export_peft_adapter(chunks, cfg, lora, adapter_dir, dtype="float32")
    export_hf(chunks, cfg, merged_dir, dtype="float32")
    last = (
        ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    )
    return logits if last else None


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


CASES = [  # (arch, TP, PP, targets)
    ("llama", 1, 1, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    pytest.param(
        "smollm2",
        2,
        2,
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        marks=pytest.mark.slow,
    ),  # zero-padded heads at TP 2, tied embeddings
    pytest.param(
        "gpt2", 2, 1, ["linear_qkv", "linear_proj", "linear_fc2"], marks=pytest.mark.slow
    ),  # fused c_attn, Conv1D (fan_in_fan_out), no fc1
]


@pytest.mark.parametrize("arch, tp, pp, targets", CASES)
def test_peft_adapter_and_merged_export_reproduce_the_engine(tmp_path, arch, tp, pp, targets):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_hf_folder(arch, str(tmp_path / "hf"))
    base = build_tiny_hf_model(arch)
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(1, base.config.vocab_size, (2, 12), generator=g)
    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    results = run_ranks(
        _engine_export,
        world_size=tp * pp,
        hf_dir=hf_dir,
        tp=tp,
        pp=pp,
        input_ids=input_ids,
        adapter_dir=adapter_dir,
        merged_dir=merged_dir,
        targets=targets,
    )
    engine = next(r for r in results if r is not None)[..., : base.config.vocab_size]
    engine_logps = token_logps(engine, input_ids)

    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    peft_model = PeftModel.from_pretrained(build_tiny_hf_model(arch), adapter_dir).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=input_ids).logits
        base_logits = base(input_ids=input_ids).logits
    assert _rel(base_logits, peft_logits) > 1e-2  # the adapters loaded and change the model
    assert _rel(token_logps(peft_logits, input_ids), engine_logps) < 1e-5

    # Merged folder: every adapted HF weight is base + (alpha / r) B A of the PEFT tensors,
    # every other tensor is the base's, and the merged model gives the same log-probs.
    adapter = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base_state, merged_state = base.state_dict(), merged.state_dict()
    adapted = 0
    for name, tensor in base_state.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if f"{key}.lora_A.weight" in adapter:
            delta = adapter[f"{key}.lora_B.weight"] @ adapter[f"{key}.lora_A.weight"] * ALPHA / RANK
            if config["fan_in_fan_out"]:
                delta = delta.t()  # GPT-2's Conv1D stores [in, out]
            assert torch.allclose(merged_state[name], tensor + delta, rtol=0, atol=1e-6), name
            adapted += 1
        elif name in merged_state:
            assert torch.equal(merged_state[name], tensor), name
    assert adapted == len(adapter) // 2 > 0
    with torch.no_grad():
        merged_logits = merged(input_ids=input_ids).logits
    assert _rel(token_logps(merged_logits, input_ids), engine_logps) < 1e-5
