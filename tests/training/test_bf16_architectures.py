"""bf16 as a GPU runs it, for every architecture: tiny random transformers models of Llama,
Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-NeoX, GPT-2, SmolLM3 (NoPE and sliding-window
layers), OLMo 3 (post-norms, projection-wide q/k norms, sliding windows), Gemma 3 (sandwich
(1 + w) norms, GeGLU, scaled embeddings, windows with their own RoPE), DeepSeek-V3
(multi-latent attention, dense first layer, shared expert, sigmoid routing) and gpt-oss
(attention sinks, biases, alternating windows, YaRN, clamped SwiGLU experts), imported at
TP 2 x PP 2 (EP 2 for the mixture-of-experts models) with ``model.params_dtype=bfloat16``,
through the real ``Trainer``.

For each architecture, in one 4-rank launch:

- an fp32 step at the same layout: its ``logps/chosen`` / ``logps/rejected`` equal transformers'
  (fp32) within 1e-5 relative, which pins what the metrics mean;
- two bf16 steps with a checkpoint after the first: step 1 has policy == reference, so the loss is
  exactly ln 2 (the rewards cancel bit for bit), the margins and the accuracy are 0; its log-probs
  are within :data:`BF16_RTOL` of the fp32 step's and of transformers'; step 2 comes after one
  optimizer step (its loss is no longer ln 2);
- a bf16 resume from the step-1 checkpoint: step 2 equals the uninterrupted run's exactly;
- for the newer architectures also an fp32 step on packed shared-prompt rows: log-probs
  equal transformers' within 1e-5, the loss is ln 2 and the margins and the accuracy are 0.

Before the model dtype had one owner (``models.gpt.place_chunk``), GPT-2 failed here at its first
LayerNorm: megatron-core's learned position embedding stayed fp32 beside bf16 weights.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.engine import tiny_pairs, tiny_trainer
from tests.models.conversion_helpers import FAMILIES, build_tiny_hf_model, save_tiny_hf_folder
from tests.multirank import run_ranks
from tests.training.test_lifecycle import read_metrics

pytestmark = pytest.mark.slow

ARCHITECTURES = FAMILIES
MOE = {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"}
SHARED_PROMPT = {"smollm3", "olmo3", "gemma3", "deepseek_v3", "gpt_oss"}
"""Also run an fp32 step with packed shared-prompt rows (per-layer windows and RoPE on
the rejected branch, whose positions continue after the prompt)."""
VOCAB = 128  # the smallest tiny vocabulary: every id is valid for every architecture
BF16_RTOL = 2e-2
"""bf16 log-probs against fp32, relative, per summed sequence log-prob (a bf16 mantissa has
8 bits: 4e-3 per rounding; four layers of rounded activations stay within 2e-2 here)."""


def _runs(root: str, archs: list[str]) -> None:
    """For each architecture: fp32 (1 step), bf16 (2 steps, saving step 1 only), bf16 resumed."""
    from megatron.core import parallel_state as ps

    for arch in archs:
        hf_dir = os.path.join(root, arch, "hf")
        layout = dict(tp=2, pp=2, ep=2, etp=1, sp=True) if arch in MOE else dict(tp=2, pp=2)
        shared = [("fp32_shared", "float32", 1, "none")] if arch in SHARED_PROMPT else []
        for name, dtype, steps, resume in shared + [
            ("fp32", "float32", 1, "none"),
            ("bf16", "bfloat16", 2, "none"),
            (
                "bf16_resumed",
                "bfloat16",
                2,
                os.path.join(root, arch, "bf16", "checkpoints", "iter_0000001"),
            ),
        ]:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            trainer = tiny_trainer(
                tiny_pairs(8, seed=5, vocab=VOCAB),
                **layout,
                micro_batch_size=2,
                global_batch_size=8,
                steps=steps,
                lr=1e-3,
                seed=3,
                run_dir=os.path.join(root, arch, name),
                resume=resume,
                **(dict(packing=True, share_prompt=True) if name == "fp32_shared" else {}),
                model={"hf_path": hf_dir, "params_dtype": dtype, "transformer_impl": "local"},
            )
            # Only the bf16 run's step-1 checkpoint is read (by the resumed run): the other saves
            # a run makes (its last step, always) would cost a collective save per run for nothing.
            trainer.checkpointer.due = lambda step, last_step, name=name: (
                name == "bf16" and step == 1
            )
            trainer.train()


def _hf_logps(arch: str, model=None) -> tuple[float, float]:
    """transformers' (fp32) mean summed completion log-probs of the chosen and rejected sides of
    the engine tests' pairs (``tiny_pairs(8, seed=5)``), under ``model`` (default: the tiny random
    ``arch`` model; e.g. a PEFT model on it)."""
    model = model if model is not None else build_tiny_hf_model(arch)
    sums = {"chosen": [], "rejected": []}
    with torch.no_grad():
        for pair in tiny_pairs(8, seed=5, vocab=VOCAB):
            for side in sums:
                completion = getattr(pair, f"{side}_ids")
                ids = torch.tensor([pair.prompt_ids + completion])
                logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
                targets = ids[0, 1:]
                per_token = logps.gather(-1, targets[:, None])[:, 0]
                sums[side].append(per_token[-len(completion) :].sum().item())
    return tuple(sum(v) / len(v) for v in (sums["chosen"], sums["rejected"]))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_every_architecture_trains_in_bf16_at_tp2_pp2_and_resumes_exactly(tmp_path):
    for arch in ARCHITECTURES:
        save_tiny_hf_folder(arch, str(tmp_path / arch / "hf"))
    run_ranks(_runs, world_size=4, timeout=1800, root=str(tmp_path), archs=ARCHITECTURES)
    for arch in ARCHITECTURES:
        runs = {
            name: read_metrics(tmp_path / arch / name) for name in ("fp32", "bf16", "bf16_resumed")
        }
        hf = dict(zip(("logps/chosen", "logps/rejected"), _hf_logps(arch)))
        fp32, bf16 = runs["fp32"][1], runs["bf16"][1]
        for key, want in hf.items():
            assert _rel(fp32[key], want) <= 1e-5, (arch, "fp32 vs transformers", key)
            assert _rel(bf16[key], fp32[key]) <= BF16_RTOL, (arch, "bf16 vs fp32", key)
            assert _rel(bf16[key], want) <= BF16_RTOL, (arch, "bf16 vs transformers", key)
        if arch in SHARED_PROMPT:
            shared = read_metrics(tmp_path / arch / "fp32_shared")[1]
            for key, want in hf.items():
                assert _rel(shared[key], want) <= 1e-5, (arch, "shared prompt vs transformers", key)
            assert shared["loss"] == pytest.approx(math.log(2), abs=1e-7), arch
            # one-row packed micro-batches at TP 2: policy and reference agree to the bit
            assert shared["rewards/margins"] == shared["rewards/accuracies"] == 0.0, arch
        assert bf16["loss"] == pytest.approx(math.log(2), abs=1e-7), arch
        assert bf16["rewards/margins"] == bf16["rewards/accuracies"] == 0.0, arch
        assert runs["bf16"][2]["loss"] != bf16["loss"], arch  # one optimizer step was taken
        assert sorted(runs["bf16_resumed"]) == [2], arch
        for key in ("loss", "grad_norm", "logps/chosen", "rewards/margins"):
            assert runs["bf16_resumed"][2][key] == pytest.approx(
                runs["bf16"][2][key], rel=1e-6, abs=1e-9
            ), (arch, "exact resume", key)
