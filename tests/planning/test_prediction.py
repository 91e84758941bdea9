"""The planner against what the engine allocates, at 14 layouts of tiny models on gloo ranks.

Each layout trains a real ``Trainer`` for two steps inside ``tests.device_memory.AllocationTracker``
(every byte an op allocates, as ``torch.cuda.max_memory_allocated`` counts on a GPU). On every
rank the planner's parameter count and its weight, gradient and optimizer bytes
(``dpo_megatron.planning.memory.static_bytes`` for that rank's stage and data-parallel shard)
must equal the engine's own objects exactly (``tests.device_memory.engine_static_bytes``), and
its peak for the rank's stage must be within 15% of the most bytes the rank held from building
the trainer to the end of step 2.

The layouts cover dense and MoE models (EP 2), LoRA, context parallelism, the interleaved
pipeline, a precomputed reference, full and selective recomputation, shared prompts, tied
embeddings over pipeline stages, the optimizer with and without sharding, fp32 and bf16.
"""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.slow

PROMPT, COMPLETION = 32, 64
"""Every pair: a 32-token prompt and two 64-token completions, so each sequence is exactly
``data.max_length`` = 96 tokens (a multiple of every row granule used) and the planner's
worst case is the run itself."""
MODEL = dict(
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=768,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=4096,
    tie_word_embeddings=False,
    fused_lm_head=True,
)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=384, moe_aux_loss_coeff=0.0)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

ONE_RANK = {
    "fp32, fused head": {},
    "bf16, unfused head, full recompute": dict(
        model=dict(params_dtype="bfloat16", fused_lm_head=False, **FULL)
    ),
    "selective recompute, shared prompts": dict(
        model=dict(recompute_granularity="selective"), packing=True, share_prompt=True
    ),
}
TWO_RANKS = {
    "TP 2 + sequence parallel, bf16": dict(tp=2, sp=True, model=dict(params_dtype="bfloat16")),
    "PP 2, precomputed reference, tied": dict(
        pp=2, micro_batch_size=1, reference_mode="precomputed", model=dict(tie_word_embeddings=True)
    ),
    "DP 2, no distributed optimizer": dict(micro_batch_size=1, use_distributed_optimizer=False),
    "CP 2, packed": dict(cp=2, packing=True),
    "LoRA at TP 2": dict(tp=2, lora=8),
}
FOUR_RANKS = {
    "TP 2 x PP 2 x VPP 2": dict(tp=2, pp=2, vpp=2, micro_batch_size=1),
    "MoE: TP 2 x EP 2, expert TP 1": dict(tp=2, sp=True, ep=2, etp=1, model=MOE),
    "MoE: EP 2 x DP 2 (DP 4), bf16": dict(
        ep=2, micro_batch_size=1, model=dict(params_dtype="bfloat16", **MOE)
    ),
    "PP 2 x DP 2, full recompute": dict(pp=2, micro_batch_size=1, model=FULL),
    "DP 4, LoRA, bf16": dict(micro_batch_size=1, lora=4, model=dict(params_dtype="bfloat16")),
    "TP 4": dict(tp=4),
}


def _pairs():
    from tests.engine import random_pairs

    return random_pairs(
        32, 3, lambda i: (PROMPT, COMPLETION, COMPLETION), vocab=MODEL["vocab_size"]
    )


def _measure_layouts(layouts: dict) -> dict:
    """Train each layout for two steps on these ranks; this rank's measured and predicted
    bytes per layout."""
    import dataclasses

    from megatron.core import parallel_state as ps

    from dpo_megatron.losses import build_loss
    from dpo_megatron.planning.from_config import numerics_for, workload_for
    from dpo_megatron.planning.hardware import host_cluster
    from dpo_megatron.planning.memory import stage_memory, static_bytes
    from dpo_megatron.planning.parameters import stage_parameters
    from dpo_megatron.training.run_data import RunData
    from dpo_megatron.training.trainer import Trainer
    from tests.device_memory import AllocationTracker, engine_static_bytes
    from tests.engine import engine_config

    out = {}
    for name, spec in layouts.items():
        spec = dict(spec)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()  # the next layout may split the ranks otherwise
        lora = spec.pop("lora", None)
        model = {**MODEL, **spec.pop("model", {})}
        spec.setdefault("micro_batch_size", 2)
        cfg = engine_config(model=model, steps=2, global_batch_size=4, **spec)
        cfg.data.max_length, cfg.data.max_prompt_length = PROMPT + COMPLETION, PROMPT
        if lora:
            cfg.lora.enabled, cfg.lora.rank = True, lora
        with AllocationTracker() as memory:
            trainer = Trainer(cfg, data=RunData(_pairs(), [], 0))
            trainer.train_step()
            trainer.train_step()
        measured = engine_static_bytes(trainer)
        parallel = dataclasses.replace(
            trainer.cfg.parallel, data_parallel_size=ps.get_data_parallel_world_size()
        )
        model_cfg = trainer.model_config
        loss_fn = build_loss(trainer.cfg.loss)
        numerics = numerics_for(model_cfg, host_cluster(1, 1.0, 1.0))
        workload = workload_for(trainer.cfg, loss_fn, model_cfg, cfg.train.micro_batch_size)
        stage = ps.get_pipeline_model_parallel_rank()
        lora_cfg = trainer.cfg.lora if lora else None
        chunks = stage_parameters(model_cfg, parallel, stage, lora_cfg)
        predicted = static_bytes(
            chunks,
            parallel,
            numerics,
            cfg.train.use_distributed_optimizer,
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
        )
        peak = stage_memory(
            model_cfg,
            parallel,
            workload,
            numerics,
            stage,
            cfg.train.use_distributed_optimizer,
            lora=lora_cfg,
        )
        out[name] = {
            "measured": measured,
            "predicted": predicted,
            "measured_peak": memory.peak,
            "predicted_peak": peak.total,
        }
    return out


@pytest.mark.parametrize(
    "world, layouts", [(1, ONE_RANK), (2, TWO_RANKS), (4, FOUR_RANKS)], ids=["1", "2", "4"]
)
def test_planner_equals_the_engine_static_bytes_and_peak_within_15_percent(world, layouts):
    ranks = run_ranks(_measure_layouts, world_size=world, timeout=1200, layouts=layouts)
    for rank, results in enumerate(ranks):
        for name, r in results.items():
            where = f"{name}, rank {rank}"
            assert r["predicted"] == r["measured"], where
            ratio = r["predicted_peak"] / r["measured_peak"]
            assert 0.85 <= ratio <= 1.15, f"{where}: peak {ratio:.3f} x measured"
