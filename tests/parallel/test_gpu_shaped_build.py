"""Placement as a GPU would see it: build every architecture through the engine's CUDA branch on
a CPU-only machine and check that nothing is left on the host.

On the CPU the engine's device *is* the host, so a placement check there proves nothing. Here
the engine is told its device is ``cuda:0`` (so megatron-core takes its GPU branch:
``use_cpu_initialization=False``, buffers on ``torch.cuda.current_device()``), and every CUDA
allocation is sent to ``meta`` instead (/work/shared/MEGATRON_CPU_NOTES.md, "A GPU-shaped
build"). Whatever still sits on ``cpu`` afterwards was made on the host by a plain factory and
never moved: on a GPU it would stay in host memory and the first forward would fail.

For each architecture, dense and MoE, fp32 and bf16, with and without LoRA: every parameter,
buffer and tensor attribute (megatron-core's RoPE ``inv_freq``) of every chunk is off the host, and
every floating parameter has the model dtype.
Before ``models.gpt.place_chunk`` the norms (``models.norms``), Qwen3's QK norms and GPT-2's
learned position embedding were all on ``cpu``: :func:`test_a_build_without_placement_is_caught`
shows that this check sees it.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.conversion_helpers import FAMILIES, save_tiny_hf_folder
from tests.multirank import run_ranks

ARCHITECTURES = FAMILIES


def _host_tensors(chunks) -> list[str]:
    """Names of every parameter, buffer and tensor attribute of ``chunks`` still on the host."""
    found = []
    for i, chunk in enumerate(chunks):
        for name, t in list(chunk.named_parameters()) + list(chunk.named_buffers()):
            if t.device.type == "cpu":
                found.append(f"chunk {i}: {name}")
        for mod_name, module in chunk.named_modules():
            for attr, value in vars(module).items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    found.append(f"chunk {i}: {mod_name}.{attr} (attribute)")
    return found


def _wrong_dtypes(chunks, dtype: torch.dtype) -> list[str]:
    return [
        f"{name}: {p.dtype}"
        for c in chunks
        for name, p in c.named_parameters()
        if p.is_floating_point() and p.dtype != dtype
    ]


def _gpu_shaped_builds(cases: list[tuple[str, str, str, bool]], place: bool = True) -> dict:
    """Build each (architecture, HF folder, params dtype, LoRA) case through the CUDA branch
    with CUDA allocations on ``meta``; returns {case: (host tensors, wrong dtypes)}."""
    from dpo_megatron.compat import cuda_on_cpu
    from dpo_megatron.models import ModelConfig, build_model_chunks, gpt, model_config_from_hf
    from dpo_megatron.models.lora import attach_lora
    from dpo_megatron.models.lora_config import LoraConfig
    from dpo_megatron.parallel import ParallelConfig, device, initialize_distributed, set_seed
    from dpo_megatron.parallel.device import get_device

    parallel = ParallelConfig()
    initialize_distributed(parallel)  # gloo: the CPU redirection is on underneath
    set_seed(0)
    device._DEVICE = torch.device("cuda", 0)  # the engine now believes it is on a GPU
    cuda_on_cpu.enable("meta")  # and every CUDA allocation lands on meta
    # The all-to-all MoE dispatcher makes a side stream in its GPU branch: no tensor, no place.
    torch.cuda.Stream = lambda *args, **kwargs: object()
    if not place:
        gpt.place_chunk = lambda chunk, dtype: None  # the defect: nothing moves the model
    assert get_device().type == "cuda"
    out = {}
    for arch, hf_dir, dtype, lora in cases:
        cfg = model_config_from_hf(
            hf_dir, ModelConfig(params_dtype=dtype, transformer_impl="local")
        )
        chunks = build_model_chunks(cfg, parallel)
        if lora:
            attach_lora(chunks, LoraConfig(enabled=True, rank=4), cfg, seed=0)
        want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        out[f"{arch}/{dtype}/lora={lora}"] = (_host_tensors(chunks), _wrong_dtypes(chunks, want))
    return out


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: save_tiny_hf_folder(arch, str(root / arch)) for arch in ARCHITECTURES}


def test_every_architecture_is_built_on_the_device_in_its_dtype(hf_folders):
    cases = [
        (arch, hf_folders[arch], dtype, False)
        for arch in ARCHITECTURES
        for dtype in ("float32", "bfloat16")
    ]
    cases += [
        (arch, hf_folders[arch], "bfloat16", True) for arch in ("llama", "qwen3_moe", "gpt_oss")
    ]
    results = run_ranks(_gpu_shaped_builds, world_size=1, cases=cases)[0]
    assert len(results) == len(cases)
    for case, (host, dtypes) in results.items():
        assert host == [], f"{case}: left on the host:\n" + "\n".join(host)
        assert dtypes == [], f"{case}: not in the model dtype:\n" + "\n".join(dtypes)


def test_a_build_without_placement_is_caught(hf_folders):
    cases = [(arch, hf_folders[arch], "bfloat16", False) for arch in ("llama", "qwen3", "gpt2")]
    results = run_ranks(_gpu_shaped_builds, world_size=1, cases=cases, place=False)[0]
    host = {case: names for case, (names, _) in results.items()}
    assert any(n.endswith("input_layernorm.weight") for n in host["llama/bfloat16/lora=False"])
    assert any("k_layernorm" in n for n in host["qwen3/bfloat16/lora=False"])
    assert any("position_embeddings" in n for n in host["gpt2/bfloat16/lora=False"])
    dtypes = results["gpt2/bfloat16/lora=False"][1]
    assert any("position_embeddings" in n and "float32" in n for n in dtypes), dtypes
