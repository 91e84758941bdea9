"""Qwen3, Qwen3-MoE, Mixtral and GPT-NeoX (and Llama-3.2 / Qwen2.5 through the existing tables):
HF -> megatron-core -> HF at every layout, against transformers.

One 4-rank launch for all architectures imports a tiny random transformers model of each at each
layout in turn (megatron-core's parallel state is rebuilt between layouts; the module fixture
``runs``): one rank, and TP 2 x PP 2
(every tensor split and the layer split at once: a slice mapped to the wrong rank or stage
fails there as it would at TP 2 or PP 2 alone) and, for the mixture-of-experts models,
expert parallel 2 with data parallel 4 (expert data parallel 2) and TP 2 x EP 2 (expert TP 2),
with the all-to-all token dispatcher (the default) and again with the all-gather one; the
newer architectures (SmolLM3: NoPE and sliding-window layers; OLMo 3: post-norms, q/k norms
over the whole projection, sliding windows; Gemma 3: sandwich (1 + w) norms, GeGLU, scaled
embeddings, windowed layers with their own RoPE theta; windows shorter than the
sequences) at every TP x PP in {1, 2}^2, and DeepSeek-V3 (multi-latent attention, a dense first
layer, a shared expert, sigmoid routing with a score bias and expert groups, routed scaling) at
every TP x PP, EP 2 and TP 2 x EP 2, and gpt-oss (attention sinks, biases everywhere, windows
in alternate layers, YaRN, a biased router, clamped SwiGLU experts stored stacked) at every
TP x PP, EP 2 and TP 2 x EP 2 (expert TP 1: biased experts; TP 2 always with EP 2). At each layout:

- a right-padded batch: logits (gathered over TP) and per-token log-probs equal transformers'
  within 1e-5 relative (fp32) at every non-padding position;
- packed rows (two sequences per row, positions restarting, block-diagonal attention): every
  sequence's log-probs equal transformers' on that sequence alone, within 1e-5;
- the export holds exactly the original tensors, bit for bit, and ``from_pretrained`` loads it
  with no missing, unexpected or mismatched keys.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.models.conversion_helpers import (
    NEW_TINY_CONFIGS,
    VARIANT_TINY_CONFIGS,
    build_tiny_hf_model,
    pipeline_logits,
    save_tiny_hf_folder,
    token_logps,
)
from tests.models.test_conversion_parity import (
    _batch,
    _import_forward_export,
    _load_all,
    _prepare_case,
    _verify_case,
)
from tests.multirank import run_cases, run_ranks

A2A, GATHER = "alltoall", "allgather"
DENSE_LAYOUTS = [(1, 1, 1, A2A), (2, 2, 1, A2A)]
# (TP, PP, EP, MoE token dispatcher)
MOE_LAYOUTS = DENSE_LAYOUTS + [(1, 1, 2, A2A), (2, 1, 2, A2A), (1, 1, 2, GATHER), (2, 1, 2, GATHER)]
MOE = {"qwen3_moe", "mixtral"}
# The newer architectures are checked at every TP x PP in {1, 2}^2 (their per-layer
# patterns, NoPE and sliding windows, must follow the layers onto their pipeline stage).
ALL_TP_PP = {"smollm3", "olmo3", "gemma3"}
TP_PP_LAYOUTS = [(1, 1, 1, A2A), (1, 2, 1, A2A), (2, 1, 1, A2A), (2, 2, 1, A2A)]
# DeepSeek-V3 (multi-latent attention, dense first layer, shared expert, sigmoid routing with a
# score bias and expert groups): every TP x PP, EP 2 x DP 4 and TP 2 x EP 2, both dispatchers.
MLA_LAYOUTS = TP_PP_LAYOUTS + [(1, 1, 2, A2A), (2, 1, 2, A2A), (2, 1, 2, GATHER)]
# gpt-oss: every TP x PP and EP 2 x DP 4 (the dispatchers are the MoE layer's, checked above).
# Its biased experts run at expert TP 1, so at TP 2 with EP 2 (models.moe.check_moe: EP x expert
# TP a multiple of TP).
OSS_LAYOUTS = [(1, 1, 1, A2A), (1, 2, 1, A2A), (2, 1, 2, A2A), (2, 2, 2, A2A), (1, 1, 2, A2A)]
WORLD = 4

# Packed rows: (sequence lengths) per row, the rest of the row is a tail of its own.
PACKED_ROWS = [(7, 5), (9, 4)]
PACKED_LENGTH = 16


def _packed(vocab: int, seed: int = 11):
    """Two packed rows [2, 16]: tokens, restarting positions, segment ids (tail: -1 - row), and
    the list of (row, start, length) of every sequence."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(PACKED_ROWS), PACKED_LENGTH, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    segments = torch.zeros(len(PACKED_ROWS), PACKED_LENGTH, dtype=torch.int32)
    spans = []
    for r, lengths in enumerate(PACKED_ROWS):
        segments[r] = -1 - r
        offset = 0
        for j, n in enumerate(lengths):
            tokens[r, offset : offset + n] = torch.randint(1, vocab, (n,), generator=g)
            positions[r, offset : offset + n] = torch.arange(n)
            segments[r, offset : offset + n] = 10 * r + j
            spans.append((r, offset, n))
            offset += n
        positions[r, offset:] = torch.arange(PACKED_LENGTH - offset)
    return tokens, positions, segments, spans


def _each_layout(hf_dir, layouts, input_ids, packed, out_root):
    """Import, forward (padded and packed) and export at every layout, in these ranks."""
    from megatron.core import parallel_state as ps

    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        export_hf,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    tokens, positions, segments = packed
    results = []
    for tp, pp, ep, dispatcher in layouts:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel = ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )
        base = ModelConfig(
            params_dtype="float32", transformer_impl="local", moe_token_dispatcher=dispatcher
        )
        cfg = model_config_from_hf(hf_dir, base)
        # megatron-core's MoE layer runs TP only with sequence parallelism; biased experts
        # (gpt-oss) only at expert TP 1 (models.moe.check_moe).
        parallel.sequence_parallel = bool(cfg.num_experts) and tp > 1
        if cfg.num_experts and cfg.add_bias_linear:
            parallel.expert_tensor_parallel_size = 1
        initialize_distributed(parallel)
        set_seed(1234)  # random init differs from the HF weights: loading must overwrite all
        chunks = build_model_chunks(cfg, parallel)
        load_hf_weights(chunks, cfg, hf_dir)
        padded = pipeline_logits(chunks, input_ids)
        packed_logits = pipeline_logits(
            chunks, tokens, position_ids=positions, segment_ids=segments
        )
        export_hf(
            chunks, cfg, os.path.join(out_root, _name(tp, pp, ep, dispatcher)), dtype="float32"
        )
        owner = (
            padded is not None
            and ps.get_data_parallel_rank() == 0
            and (ps.get_tensor_model_parallel_rank() == 0)
        )
        results.append((padded, packed_logits) if owner else None)
    return results


def _name(tp, pp, ep, dispatcher):
    return f"tp{tp}pp{pp}ep{ep}{dispatcher}"


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _prepare_arch(folder, arch) -> dict:
    """The tiny ``arch`` folder under ``folder``, transformers' outputs on the padded batch and on
    each packed sequence alone, and the kwargs of :func:`_each_layout` (``run``)."""
    hf_dir = save_tiny_hf_folder(arch, str(folder / "hf"))
    model = build_tiny_hf_model(arch)
    vocab = model.config.vocab_size
    input_ids, mask = _batch(vocab)
    tokens, positions, segments, spans = _packed(vocab)
    with torch.no_grad():
        ref_logits = model(input_ids=input_ids, attention_mask=mask).logits
        ref_packed = [model(input_ids=tokens[r, s : s + n][None]).logits[0] for r, s, n in spans]
    layouts = (
        MOE_LAYOUTS
        if arch in MOE
        else MLA_LAYOUTS
        if arch == "deepseek_v3"
        else OSS_LAYOUTS
        if arch == "gpt_oss"
        else TP_PP_LAYOUTS
        if arch in ALL_TP_PP
        else DENSE_LAYOUTS
    )
    return {
        "arch": arch,
        "hf_dir": hf_dir,
        "model_class": type(model).__name__,
        "vocab": vocab,
        "input_ids": input_ids,
        "mask": mask,
        "tokens": tokens,
        "spans": spans,
        "ref_logits": ref_logits,
        "ref_packed": ref_packed,
        "layouts": layouts,
        "out_root": str(folder / "out"),
        "run": dict(
            hf_dir=hf_dir,
            layouts=layouts,
            input_ids=input_ids,
            packed=(tokens, positions, segments),
            out_root=str(folder / "out"),
        ),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (prepared, results by rank)}``: every architecture of NEW_TINY_CONFIGS at its
    layouts and each of VARIANT_TINY_CONFIGS at TP 2 x PP 2 (``variant_{arch}``), all in one
    world of 4 ranks."""
    root = tmp_path_factory.mktemp("new_architectures")
    prepared = {arch: _prepare_arch(root / arch, arch) for arch in sorted(NEW_TINY_CONFIGS)}
    cases = {arch: (_each_layout, p["run"]) for arch, p in prepared.items()}
    for arch in sorted(VARIANT_TINY_CONFIGS):
        prepared[f"variant_{arch}"] = case = _prepare_case(root / f"variant_{arch}", arch, 2, 2)
        cases[f"variant_{arch}"] = (_import_forward_export, case["run"])
    results = run_cases(WORLD, cases, timeout=2400)
    return {name: (p, results[name]) for name, p in prepared.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(NEW_TINY_CONFIGS))
def test_every_layout_matches_transformers_and_round_trips(runs, arch):
    from transformers import AutoModelForCausalLM

    prepared, per_rank = runs[arch]
    vocab, input_ids, mask = prepared["vocab"], prepared["input_ids"], prepared["mask"]
    tokens, spans, layouts = prepared["tokens"], prepared["spans"], prepared["layouts"]
    ref_logits, ref_packed = prepared["ref_logits"], prepared["ref_packed"]
    out_root = prepared["out_root"]
    assert len(per_rank) == WORLD
    original = _load_all(prepared["hf_dir"])
    real, target = mask.bool(), mask[:, 1:].bool()
    ref_logps = token_logps(ref_logits, input_ids)
    for k, (tp, pp, ep, dispatcher) in enumerate(layouts):
        owners = [r[k] for r in per_rank if r[k] is not None]
        assert len(owners) == 1, layouts[k]
        padded, packed = owners[0]
        where = f"{arch} at TP {tp} x PP {pp} x EP {ep} ({dispatcher})"
        padded = padded[..., :vocab]
        assert _rel(padded[real], ref_logits[real]) <= 1e-5, where
        logps = token_logps(padded, input_ids)
        assert ((logps - ref_logps).abs() / ref_logps.abs())[target].max() <= 1e-5, where
        for (r, s, n), ref in zip(spans, ref_packed):
            got = packed[r, s : s + n, :vocab]
            seq = tokens[r, s : s + n][None]
            assert _rel(token_logps(got[None], seq), token_logps(ref[None], seq)) <= 1e-5, where
        exported = _load_all(os.path.join(out_root, _name(tp, pp, ep, dispatcher)))
        assert sorted(exported) == sorted(original), where
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (where, name)
    last = layouts[-1]
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        os.path.join(out_root, _name(*last)), output_loading_info=True
    )
    assert type(reloaded).__name__ == prepared["model_class"]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(VARIANT_TINY_CONFIGS))
def test_untied_qwen3_and_llama31_at_tp2_pp2(runs, arch):
    """Qwen3 with its own output layer, Llama-3.1's RoPE scaling (factor 8) and DeepSeek-V3 with
    YaRN (factor 32, mscale_all_dim 1): logits and log-probs equal transformers' within 1e-5 at
    TP 2 x PP 2, export bit-exact and loadable."""
    from dpo_megatron.models import model_config_from_hf

    case, results = runs[f"variant_{arch}"]
    _verify_case(case, results)
    cfg = model_config_from_hf(case["hf_dir"])
    assert cfg.tie_word_embeddings is False
    if arch == "llama31":
        assert cfg.rope_scaling_factor == 8.0
    if arch == "deepseek_v3_yarn":  # YaRN of multi-latent attention
        assert cfg.rope_yarn_factor == 32.0 and cfg.rope_yarn_mscale_all_dim == 1.0


def _names_read(hf_dir, ep):
    """Import at EP ``ep`` (DP = world size), recording the tensor names this rank reads."""
    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.models.conversion.hf_files import HFCheckpointReader
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    names = []
    original = HFCheckpointReader.read

    def recording_read(self, name, *args, **kwargs):
        names.append(name)
        return original(self, name, *args, **kwargs)

    HFCheckpointReader.read = recording_read  # this forked rank only
    parallel = ParallelConfig(expert_model_parallel_size=ep)
    initialize_distributed(parallel)
    set_seed(0)
    cfg = model_config_from_hf(
        hf_dir, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    load_hf_weights(build_model_chunks(cfg, parallel), cfg, hf_dir)
    return names


@pytest.mark.slow
def test_each_expert_parallel_rank_reads_only_its_experts(tmp_path):
    """At EP 2 rank k reads experts 2k and 2k+1 of every layer, and every dense tensor."""
    hf_dir = save_tiny_hf_folder("qwen3_moe", str(tmp_path / "hf"))
    per_rank = run_ranks(_names_read, world_size=2, hf_dir=hf_dir, ep=2)
    experts = [{n for n in names if ".experts." in n} for names in per_rank]
    dense = [{n for n in names if ".experts." not in n} for names in per_rank]
    everything = set(_load_all(hf_dir))
    assert experts[0] | experts[1] == {n for n in everything if ".experts." in n}
    assert not experts[0] & experts[1]
    for rank, names in enumerate(experts):
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in names} == {
            2 * rank,
            2 * rank + 1,
        }
    assert dense[0] == dense[1] == {n for n in everything if ".experts." not in n}
