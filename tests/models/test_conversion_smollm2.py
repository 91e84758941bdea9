"""Real weights: SmolLM2-135M-Instruct (9 query / 3 key-value heads, tied embeddings) imported at
TP 2 x PP 2 (zero-head padding to 4 groups), compared with transformers on real chat text, then
exported and reloaded by transformers.

The HF folder comes from ``scripts/assets.py::ensure_smollm2`` (built from a pip package; the
test is skipped where that is impossible).
"""

import os

import pytest
import torch

from tests.models.conversion_helpers import pipeline_logits, token_logps
from tests.multirank import run_ranks

CHATS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Give me two tips for writing clear documentation."},
        {
            "role": "assistant",
            "content": "Start with what the reader wants to do, and show a "
            "short example before explaining the details.",
        },
    ],
]


@pytest.fixture(scope="module")
def smollm2_dir():
    from tests.scripts import load_script

    assets = load_script("assets")  # builds a missing asset

    try:
        return str(assets.ensure_smollm2())
    except Exception as exc:  # no registry access
        pytest.skip(f"SmolLM2 asset unavailable: {exc}")


def _chat_batch(hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    rows = [tok.apply_chat_template(c, tokenize=False) for c in CHATS]
    enc = tok(rows, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def _import_logps_export(hf_dir, input_ids, out_dir, dtype):
    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        export_hf,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    initialize_distributed(parallel)
    set_seed(0)  # megatron-core's RNG tracker must exist for the attention's dropout fork
    cfg = model_config_from_hf(
        hf_dir,
        ModelConfig(params_dtype="float32", transformer_impl="local", pad_attention_heads=True),
    )
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, hf_dir)
    logits = pipeline_logits(chunks, input_ids)
    export_hf(chunks, cfg, out_dir, dtype=dtype)
    return None if logits is None else token_logps(logits[..., : cfg.vocab_size], input_ids)


@pytest.mark.slow
def test_smollm2_tp2_pp2_matches_transformers_and_exports(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.conversion_helpers import hf_logps

    input_ids, mask = _chat_batch(smollm2_dir)
    out_dir = str(tmp_path / "exported")
    results = run_ranks(
        _import_logps_export,
        world_size=4,
        hf_dir=smollm2_dir,
        input_ids=input_ids,
        out_dir=out_dir,
        dtype="bfloat16",
    )
    got = [r for r in results if r is not None][0]

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ref = hf_logps(model, input_ids, mask)
    target = mask[:, 1:].bool()
    seq_got = (got * target).sum(-1)
    seq_ref = (ref * target).sum(-1)
    assert ((seq_got - seq_ref).abs() / seq_ref.abs()).max().item() <= 1e-4
    # per token: relative where the log-prob is not tiny, absolute 1e-4 nats where it is
    err = (got - ref).abs()[target] / ref.abs()[target].clamp(min=1.0)
    assert err.max().item() <= 1e-4, err.max().item()

    exported, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert exported.dtype == torch.bfloat16
    assert os.path.isfile(os.path.join(out_dir, "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(out_dir)
    prompt = tok.apply_chat_template(CHATS[0][:1], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = exported.float().generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
