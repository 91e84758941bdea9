"""The planner's parameter list of a rank against real builds of that rank's chunks.

``dpo_megatron.planning.parameters`` derives every parameter a rank holds from the architecture
and the layout alone. Here the engine builds the same rank on the ``meta`` device in a fake
world of that layout (``tests.meta_build``: megatron-core's GPU branch, no memory), and the
names and sizes must agree one for one: every architecture family at TP 1 / 2, PP 1 / 2,
interleaved, expert parallel and with LoRA; and the real sizes the GPU recipes plan for
(Llama-3.1-8B, Llama-3.3-70B at TP 8 x PP 4; Qwen3-30B-A3B at TP 4 x PP 4 x EP 8), first and
last stage.
"""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow

LAYOUTS = [
    dict(tensor_model_parallel_size=1),
    dict(tensor_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    ),
    dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
    ),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, lora=4),
]


def _compare(models: dict, layouts: list[dict]) -> tuple[int, list]:
    """Build each (model, layout) that the engine's rules accept, first and last stage; the
    number compared and every difference {name: (planned, built)}."""
    from dpo_megatron.models.lora_config import LoraConfig
    from dpo_megatron.models.transformer_config import build_transformer_config
    from dpo_megatron.parallel import ParallelConfig
    from dpo_megatron.planning.parameters import stage_parameters
    from tests.meta_build import rank_parameters

    compared, differences = 0, []
    for name, model in models.items():
        for spec in layouts:
            spec = dict(spec)
            rank = spec.pop("lora", None)
            lora = LoraConfig(enabled=True, rank=rank) if rank else None
            parallel = ParallelConfig(**spec)
            if parallel.expert_model_parallel_size > 1 and not model.num_experts:
                continue
            if model.num_experts and parallel.tensor_model_parallel_size > 1:
                parallel.sequence_parallel = True  # as the ranks turn it on
            try:
                build_transformer_config(model, parallel)
            except ValueError:
                continue  # a layout the engine refuses (e.g. heads / TP)
            pp = parallel.pipeline_model_parallel_size
            world = parallel.launch_world_size()
            ranks = {0: 0, pp - 1: (pp - 1) * (world // pp)}  # stage -> its first global rank
            built = rank_parameters(model, parallel, sorted(set(ranks.values())), lora)
            for stage, rank_id in ranks.items():
                planned = {
                    f"chunk{i}.{p.name}": p.numel
                    for i, chunk in enumerate(stage_parameters(model, parallel, stage, lora))
                    for p in chunk
                }
                compared += 1
                if planned != built[rank_id]:
                    diff = {
                        k: (planned.get(k), built[rank_id].get(k))
                        for k in planned.keys() | built[rank_id].keys()
                        if planned.get(k) != built[rank_id].get(k)
                    }
                    differences.append((name, spec, stage, diff))
    return compared, differences


def _family_models(folders: dict) -> dict:
    from dpo_megatron.models import ModelConfig, model_config_from_hf

    return {
        arch: model_config_from_hf(folder, ModelConfig(transformer_impl="local"))
        for arch, folder in folders.items()
    }


def _compare_families(folders: dict, layouts: list[dict]):
    return _compare(_family_models(folders), layouts)


def _compare_presets(presets: dict) -> tuple[int, list]:
    from dpo_megatron.models import ModelConfig, model_config_from_hf
    from dpo_megatron.models.presets import MODEL_PRESETS

    models = {
        name: model_config_from_hf(
            MODEL_PRESETS[name].hub_name,
            ModelConfig(transformer_impl="local", params_dtype="bfloat16"),
        )
        for name in presets
    }
    out_compared, out_diff = 0, []
    for name, layout in presets.items():
        compared, diff = _compare({name: models[name]}, [layout])
        out_compared += compared
        out_diff += diff
    return out_compared, out_diff


def test_every_family_is_planned_as_built(tmp_path):
    from tests.models.conversion_helpers import FAMILIES, save_tiny_hf_folder

    folders = {a: save_tiny_hf_folder(a, str(tmp_path / a)) for a in FAMILIES}
    compared, differences = run_ranks(
        _compare_families, world_size=1, folders=folders, layouts=LAYOUTS
    )[0]
    assert differences == []
    assert compared >= 90  # every family at most layouts, first and last stage


def test_real_sizes_are_planned_as_built():
    tp8_pp4 = dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4)
    presets = {
        "llama3.1-8b": tp8_pp4,
        "llama3.3-70b": tp8_pp4,
        # 4 key/value heads: TP 4 (TP 8 would need zero-padded heads)
        "qwen3-30b-a3b": dict(
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=4,
            expert_model_parallel_size=8,
            expert_tensor_parallel_size=1,
        ),
    }
    compared, differences = run_ranks(_compare_presets, world_size=1, presets=presets)[0]
    assert differences == []
    assert compared == 6
