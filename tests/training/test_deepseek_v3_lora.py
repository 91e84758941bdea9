"""LoRA on DeepSeek-V3 (multi-latent attention + MoE) at TP 2 x PP 2 x EP 2 through the Trainer:
adapters on the attention output projection and on every MLP (the dense first layer's, the
shared expert's and each routed expert's, expert TP 1). Step 1 has the adapters' B at zero, so
the policy is the base model: the loss is exactly ln 2 and the log-probs are transformers'; step 2
comes after one optimizer step of the adapters alone."""

from __future__ import annotations

import math

import pytest

from tests.engine import tiny_pairs
from tests.models.conversion_helpers import save_tiny_hf_folder
from tests.multirank import run_ranks
from tests.training.test_bf16_architectures import VOCAB, _hf_logps, _rel
from tests.training.test_lifecycle import read_metrics

pytestmark = pytest.mark.slow

TARGETS = ["linear_proj", "linear_fc1", "linear_fc2"]
"""MLA has no fused ``linear_qkv``; its latent projections are not LoRA targets here."""


def _train(root: str, hf_dir: str) -> None:
    from tests.training.test_lora import lora_trainer

    lora_trainer(
        tiny_pairs(8, seed=5, vocab=VOCAB),
        tp=2,
        pp=2,
        ep=2,
        etp=1,
        sp=True,
        micro_batch_size=2,
        global_batch_size=8,
        steps=2,
        lr=1e-3,
        seed=3,
        run_dir=root,
        model={"hf_path": hf_dir, "params_dtype": "float32", "transformer_impl": "local"},
        lora={"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": TARGETS},
    ).train()


def test_lora_on_attention_output_and_experts_starts_at_the_base_model(tmp_path):
    hf_dir = save_tiny_hf_folder("deepseek_v3", str(tmp_path / "hf"))
    root = str(tmp_path / "run")
    run_ranks(_train, world_size=4, timeout=900, root=root, hf_dir=hf_dir)
    steps = read_metrics(tmp_path / "run")
    hf = dict(zip(("logps/chosen", "logps/rejected"), _hf_logps("deepseek_v3")))
    for key, want in hf.items():
        assert _rel(steps[1][key], want) <= 1e-5, key
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert steps[1]["rewards/margins"] == 0
    assert steps[2]["loss"] < steps[1]["loss"]  # the adapters were trained
