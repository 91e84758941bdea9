"""HF -> megatron-core -> HF at every TP x PP layout, for every architecture.

Each case imports a tiny random transformers model, runs a right-padded batch through
megatron-core's pipeline schedule and exports the model back; the cases of one world size run one
after the other in one set of ranks (the module fixture ``cases``). Checked:
- logits (gathered over TP) and per-token log-probs equal transformers' within 1e-5 relative
  (fp32) at every non-padding position;
- the exported folder holds exactly the original tensors, bit for bit, and
  ``AutoModelForCausalLM.from_pretrained`` loads it with no missing or unexpected keys.
"""

import glob
import json
import os

import pytest
import torch

from tests.models.conversion_helpers import (
    TINY_CONFIGS,
    build_tiny_hf_model,
    hf_logps,
    pipeline_logits,
    save_tiny_hf_folder,
    token_logps,
)
from tests.multirank import run_cases, run_ranks

# One rank, and TP 2 x PP 2: every split (tensor and pipeline) at once. TP or PP alone adds no
# path that TP 2 x PP 2 does not take, and each extra layout costs every architecture a run.
LAYOUTS = [(1, 1), (2, 2)]
LENGTHS = [10, 7, 4, 9]  # right padding: rows 1-3 are padded
PAD_ID = 0


def _import_forward_export(hf_dir, tp, pp, vpp, input_ids, out_dir, num_microbatches=1):
    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        export_hf,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    cfg = model_config_from_hf(
        hf_dir,
        ModelConfig(params_dtype="float32", transformer_impl="local", pad_attention_heads=True),
    )
    # megatron-core's MoE layer runs TP only with sequence parallelism (DeepSeek-V3 variant).
    parallel.sequence_parallel = bool(cfg.num_experts) and tp > 1
    initialize_distributed(parallel)
    set_seed(1234)  # random init differs from the HF weights: loading must overwrite all
    chunks = build_model_chunks(cfg, parallel)
    load_hf_weights(chunks, cfg, hf_dir)
    logits = pipeline_logits(chunks, input_ids, num_microbatches)
    export_hf(chunks, cfg, out_dir, dtype="float32")
    return logits


def _batch(vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.zeros_like(input_ids)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    return input_ids.masked_fill(mask == 0, PAD_ID), mask


def _load_all(folder):
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(path))
    for path in sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin"))):
        tensors.update(torch.load(path, weights_only=True))
    return tensors


def _prepare_case(folder, arch, tp, pp, vpp=None, num_microbatches=1, **save_kwargs) -> dict:
    """Write the tiny ``arch`` folder under ``folder`` (``hf``; the export goes to ``exported``)
    and compute transformers' logits and log-probs on the padded batch: the case's ranks'
    kwargs (``run``, for :func:`_import_forward_export` on ``tp * pp`` ranks) and what
    :func:`_verify_case` compares them with."""
    hf_dir = save_tiny_hf_folder(arch, str(folder / "hf"), **save_kwargs)
    model = build_tiny_hf_model(arch)
    input_ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        ref_logits = model(input_ids=input_ids, attention_mask=mask).logits
    out_dir = str(folder / "exported")
    return {
        "world_size": tp * pp,
        "tp": tp,
        "vocab": model.config.vocab_size,
        "mask": mask,
        "input_ids": input_ids,
        "ref_logits": ref_logits,
        "hf_dir": hf_dir,
        "ref_logps": hf_logps(model, input_ids, mask),
        "out_dir": out_dir,
        "run": dict(
            hf_dir=hf_dir,
            tp=tp,
            pp=pp,
            vpp=vpp,
            input_ids=input_ids,
            out_dir=out_dir,
            num_microbatches=num_microbatches,
        ),
    }


def _verify_case(case: dict, results: list) -> None:
    from transformers import AutoModelForCausalLM

    vocab, mask, input_ids = case["vocab"], case["mask"], case["input_ids"]
    ref_logits, ref_logps = case["ref_logits"], case["ref_logps"]
    hf_dir, out_dir = case["hf_dir"], case["out_dir"]
    logits = [r for r in results if r is not None]
    assert len(results) == case["world_size"]
    assert len(logits) == case["tp"]  # every rank of the last stage returns the gathered logits
    got = logits[0][..., :vocab]
    real = mask.bool()
    scale = ref_logits[real].abs().max()
    assert ((got - ref_logits)[real].abs().max() / scale).item() <= 1e-5
    got_logps = token_logps(got, input_ids)
    target = mask[:, 1:].bool()
    rel = ((got_logps - ref_logps).abs() / ref_logps.abs())[target]
    assert rel.max().item() <= 1e-5, rel.max().item()

    original, exported = _load_all(hf_dir), _load_all(out_dir)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], tensor), name
    index = json.load(open(os.path.join(out_dir, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == sorted(original)
    reloaded, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


def run_parity_cases(cases: dict[str, dict]) -> dict[str, list]:
    """Results by rank of every prepared case (:func:`_prepare_case`), by name: the cases of one
    world size in one set of ranks."""
    out = {}
    for world in sorted({c["world_size"] for c in cases.values()}):
        out.update(
            run_cases(
                world,
                {
                    name: (_import_forward_export, c["run"])
                    for name, c in cases.items()
                    if c["world_size"] == world
                },
            )
        )
    return out


SPECIAL = {  # name: (arch, tp, pp, vpp, micro-batches, save_tiny_hf_folder kwargs)
    # PP 2 x VPP 2: each rank holds two non-adjacent layers (global index from layer_number).
    "virtual_pipeline": ("llama", 1, 2, 2, 2, {}),
    # A folder split into many shards with an index (each rank opens only what it needs).
    "sharded": ("qwen2", 2, 2, None, 1, {"max_shard_size": "40KB"}),
    "pytorch_bin": ("mistral", 2, 1, None, 1, {"safe_serialization": False}),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """``{name: (prepared case, results by rank)}`` of every architecture at every layout
    (``{arch}_tp{t}pp{p}``) and of SPECIAL."""
    root = tmp_path_factory.mktemp("parity")
    prepared = {
        f"{arch}_tp{tp}pp{pp}": _prepare_case(root / f"{arch}_tp{tp}pp{pp}", arch, tp, pp)
        for arch in sorted(TINY_CONFIGS)
        for tp, pp in LAYOUTS
    }
    for name, (arch, tp, pp, vpp, micro, save_kwargs) in SPECIAL.items():
        prepared[name] = _prepare_case(root / name, arch, tp, pp, vpp, micro, **save_kwargs)
    results = run_parity_cases(prepared)
    return {name: (case, results[name]) for name, case in prepared.items()}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_import_matches_transformers_and_export_round_trips(cases, arch, tp, pp):
    _verify_case(*cases[f"{arch}_tp{tp}pp{pp}"])


@pytest.mark.slow
def test_virtual_pipeline_chunks(cases):
    """PP 2 x VPP 2: each rank holds two non-adjacent layers (global index from layer_number)."""
    _verify_case(*cases["virtual_pipeline"])


@pytest.mark.slow
def test_sharded_safetensors_input(cases):
    """A folder split into many shards with an index (each rank opens only what it needs)."""
    case, results = cases["sharded"]
    _verify_case(case, results)
    assert len(glob.glob(os.path.join(case["hf_dir"], "model-*.safetensors"))) > 3


@pytest.mark.slow
def test_pytorch_bin_input(cases):
    case, results = cases["pytorch_bin"]
    _verify_case(case, results)
    assert os.path.exists(os.path.join(case["hf_dir"], "pytorch_model.bin"))


@pytest.mark.slow
def test_gpt2_original_file_layout(tmp_path):
    """The original GPT-2 files: no ``transformer.`` prefix, causal-mask buffers ``h.N.attn.bias``
    saved as tensors. Imported at TP 2 they give transformers' logits."""
    from safetensors.torch import load_file, save_file

    hf_dir = save_tiny_hf_folder("gpt2", str(tmp_path / "hf"))
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    for i in range(4):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    save_file(tensors, path, metadata={"format": "pt"})
    model = build_tiny_hf_model("gpt2")
    input_ids, _ = _batch(128)
    with torch.no_grad():
        ref = model(input_ids).logits
    results = run_ranks(
        _import_forward_export,
        world_size=2,
        hf_dir=hf_dir,
        tp=2,
        pp=1,
        vpp=None,
        input_ids=input_ids,
        out_dir=str(tmp_path / "out"),
    )
    got = results[0][..., :128]
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    exported = _load_all(str(tmp_path / "out"))
    assert torch.equal(exported["transformer.h.3.mlp.c_fc.weight"], tensors["h.3.mlp.c_fc.weight"])


def _count_read_elements(hf_dir, tp, pp):
    """Import at TP x PP, counting the tensor elements this rank reads from the files."""
    from dpo_megatron.models import (
        ModelConfig,
        build_model_chunks,
        load_hf_weights,
        model_config_from_hf,
    )
    from dpo_megatron.models.conversion.hf_files import HFCheckpointReader
    from dpo_megatron.parallel import ParallelConfig, initialize_distributed, set_seed

    counted = [0]
    original = HFCheckpointReader.read

    def counting_read(self, *args, **kwargs):
        tensor = original(self, *args, **kwargs)
        counted[0] += tensor.numel()
        return tensor

    HFCheckpointReader.read = counting_read  # this forked rank only
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    initialize_distributed(parallel)
    set_seed(0)
    cfg = model_config_from_hf(
        hf_dir, ModelConfig(params_dtype="float32", transformer_impl="local")
    )
    load_hf_weights(build_model_chunks(cfg, parallel), cfg, hf_dir)
    return counted[0]


@pytest.mark.slow
def test_each_rank_reads_only_its_slices(tmp_path):
    """At TP 2 x PP 2 no rank reads more than about a quarter of the model (its layers' TP
    slices plus replicated norms); together the ranks read each element once per owner."""
    hf_dir = save_tiny_hf_folder("llama", str(tmp_path / "hf"))
    total = sum(t.numel() for t in _load_all(hf_dir).values())
    counts = run_ranks(_count_read_elements, world_size=4, hf_dir=hf_dir, tp=2, pp=2)
    assert max(counts) < 0.3 * total, (counts, total)
    assert sum(counts) < 1.01 * total, (counts, total)
