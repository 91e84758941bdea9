"""The planner's arithmetic, by hand: megatron-core's DDP buffer padding and optimizer shards,
the micro-batches a pipeline stage holds, one layer's saved activations, the LM head, step time
and the ranking."""

from __future__ import annotations

import math

import pytest

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.planning.hardware import ACCELERATORS, Cluster, find_accelerator
from dpo_megatron.planning.memory import (
    Numerics,
    Workload,
    ddp_buckets,
    in_flight,
    layer_activation_bytes,
    lm_head_bytes,
    static_bytes,
)
from dpo_megatron.planning.parameters import Param

SMALL = ModelConfig(
    num_layers=2,
    hidden_size=256,
    ffn_hidden_size=768,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=4096,
)


def test_ddp_buffer_pads_each_parameter_to_64_and_the_bucket_to_lcm_dp_128():
    params = [Param("a", 100), Param("b", 10), Param("c", 7)]
    # reverse order: c at 0..7, b at 64..74, a at 128..228; 228 -> a multiple of lcm(3, 128)
    ((size, entries),) = ddp_buckets(params, dp=3, distributed_optimizer=True)
    assert [(p.name, s, e) for p, s, e in entries] == [("c", 0, 7), ("b", 64, 74), ("a", 128, 228)]
    assert size == 384
    # without the distributed optimizer nothing is padded
    ((size, _),) = ddp_buckets(params, dp=3, distributed_optimizer=False)
    assert size == 117
    # a shared embedding gets a bucket of its own
    tied = [Param("emb", 300, shared_embedding=True), Param("w", 10)]
    buckets = ddp_buckets(tied, dp=2, distributed_optimizer=True)
    assert [size for size, _ in buckets] == [128, 384]


def test_optimizer_state_is_the_shard_of_real_elements():
    params = [Param("a", 100), Param("b", 10), Param("c", 7)]  # buffer of 384 over DP 3
    parallel = ParallelConfig(data_parallel_size=3)
    fp32, bf16 = Numerics(bf16=False, fused_lm_head=True), Numerics(bf16=True, fused_lm_head=True)
    # shards [0, 128), [128, 256), [256, 384): real elements 7 + 10, 100, 0
    shards = [
        static_bytes([params], parallel, fp32, True, dp_rank=r)["optimizer"] for r in range(3)
    ]
    assert shards == [17 * 8, 100 * 8, 0]  # Adam's two fp32 moments
    bf = static_bytes([params], parallel, bf16, True, dp_rank=1)
    assert bf == {"params": 117, "weights": 384 * 2, "grads": 384 * 4, "optimizer": 100 * 12}
    # without sharding: every element, weights unpadded, no main copy in fp32
    plain = static_bytes([params], parallel, fp32, False)
    assert plain == {"params": 117, "weights": 117 * 4, "grads": 117 * 4, "optimizer": 117 * 8}
    # frozen parameters (a LoRA base) are weights only
    frozen = [Param("base", 1000, trainable=False), Param("lora", 64)]
    lora = static_bytes([frozen], ParallelConfig(data_parallel_size=1), fp32, True)
    assert lora == {
        "params": 1064,
        "weights": 1000 * 4 + 128 * 4,
        "grads": 128 * 4,
        "optimizer": 512,
    }


def test_micro_batches_in_flight_follow_1f1b_and_the_interleaved_warm_up():
    pp4 = ParallelConfig(pipeline_model_parallel_size=4)
    assert [in_flight(pp4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(pp4, 2, r) for r in range(4)] == [2, 2, 2, 1]
    assert in_flight(ParallelConfig(), 8, 0) == 1
    # interleaved, PP 4 x VPP 2: stage 0 warms up 2 x 3 + 1 x 4 = 10 chunk passes, holds 11
    # chunks of half its layers: 1 + (PP - 1) / (PP VPP) = 1.375 micro-batches' worth
    vpp = ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert in_flight(vpp, 8, 0) == 11 / 2 == 4 * (1 + 3 / 8)
    assert in_flight(vpp, 8, 3) == 5 / 2


def test_one_layer_saves_what_its_modules_keep():
    """Per token, fp32, rotary, sdpa, SwiGLU: norm inputs 2 x h and statistics 2 x 4 bytes, the
    QKV and MLP linears' normed inputs 2 x h, the QKV output q + 2 kv, rotated q and k, the
    cos / sin tables 4 x d, the attention output q and log-sum-exp (heads x 4 bytes), the
    SwiGLU input 2 ffn and output ffn: 18,472 bytes (the engine's saved tensors give the same)."""
    h, q, kv, d, heads, ffn = 256, 256, 128, 32, 8, 768
    fp32 = Numerics(bf16=False, fused_lm_head=True)
    want = 4 * (2 * h + 2 * h + (q + 2 * kv) + (q + kv) + 4 * d + q + 3 * ffn) + 4 * heads + 2 * 4
    assert want == 18472
    assert layer_activation_bytes(SMALL, ParallelConfig(), fp32, 0) == want
    # TP 2 halves what attention and the MLP keep; sequence parallelism also the norms' part
    tp2 = layer_activation_bytes(SMALL, ParallelConfig(tensor_model_parallel_size=2), fp32, 0)
    sp2 = layer_activation_bytes(
        SMALL, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), fp32, 0
    )
    norms = 4 * 4 * h + 2 * 4
    assert tp2 == norms + (want - norms - 4 * 4 * d) / 2 + 4 * 4 * d
    assert sp2 == tp2 - norms / 2
    # recomputing the MLP drops its 3 ffn
    selective = layer_activation_bytes(SMALL, ParallelConfig(), fp32, 0, ("mlp",))
    assert selective == want - 4 * 3 * ffn


def test_lm_head_keeps_hidden_states_fused_and_logits_unfused():
    fused, unfused = Numerics(False, True), Numerics(False, False)
    kept, work = lm_head_bytes(fused, scored=100, hidden=256, vocab_shard=4096)
    assert kept == 4 * 100 * 256
    # fp32 weight gradient, hidden gradient, one chunk of 100 rows of logits
    assert work == 4 * 4096 * 256 + 4 * 100 * 256 + 4 * 100 * 4096
    kept, work = lm_head_bytes(unfused, scored=100, hidden=256, vocab_shard=4096)
    assert kept == 4 * 100 * 256 + 4 * 100 * 4096
    assert work == 4 * 4096 * 256 + 4 * 100 * 256


def test_workload_counts_a_shared_prompt_once():
    pairs = Workload(1000, 0.25, 2, True, True, 8, 1, "model")
    assert (pairs.prompt_tokens(), pairs.item_tokens(), pairs.scored_tokens()) == (250, 1750, 1500)
    unshared = Workload(1000, 0.25, 2, False, True, 8, 1, "model")
    assert unshared.item_tokens() == 2000
    sft = Workload(1000, 0.25, 1, True, True, 8, 1, "none")
    assert (sft.item_tokens(), sft.scored_tokens()) == (1000, 750)


def test_accelerators_by_short_and_device_name():
    assert find_accelerator("H100") is ACCELERATORS["h100"]
    assert find_accelerator("NVIDIA  H100 80GB HBM3").bf16_tflops == 989.4
    assert find_accelerator("NVIDIA H100 PCIe").bf16_tflops == 756.5
    assert find_accelerator("Tesla V100") is None
    cluster = Cluster(2, 8, ACCELERATORS["h200"], reserved_gib=3.0, margin=0.1)
    # a predicted peak P fits when P x 1.1 + 3 GiB <= 139.8 GiB
    assert cluster.usable_bytes == pytest.approx((139.8 - 3.0) / 1.1 * 2**30)
    assert cluster.link_gbps(8) == 450.0 and cluster.link_gbps(16) == 50.0


def test_step_time_by_hand():
    """Compute at MFU, the 1F1B bubble and a ring all-reduce's 2 (t - 1) / t."""
    from dpo_megatron.planning.memory import RankMemory
    from dpo_megatron.planning.step_time import step_time

    model = ModelConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=100
    )
    work = Workload(8, 0.5, 2, False, True, 4, 1, "precomputed")
    cluster = Cluster(1, 2, ACCELERATORS["h100"], mfu=0.5)
    memory = RankMemory(0, 0, 0, 0, 0, 0, 0, 0, 0, {"training": 0})
    layout = ParallelConfig(pipeline_model_parallel_size=2, data_parallel_size=1)
    t = step_time(model, layout, work, Numerics(True, True), memory, cluster)
    per_token = 2 * (2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 128)  # q, o, k, v, SwiGLU
    attention = 4 * 4 * 64 * 2 * (8 * 9 // 2)  # two causal sequences of 8
    forward = per_token * 4 * 16 + 2 * 64 * 100 * 8 + attention
    assert t.model_flops == 4 * forward * 3
    assert t.compute_s == pytest.approx(4 * forward * 3 / (2 * 989.4e12 * 0.5))
    assert t.bubble_s == pytest.approx(t.compute_s * 1 / 4)  # (PP - 1) / m, m = 4
    assert t.tensor_parallel_s == 0
    tp2 = ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=1)
    t2 = step_time(model, tp2, work, Numerics(True, True), memory, cluster)
    # per micro-batch and layer: 4 all-reduces of 16 tokens x 64 x 2 bytes, 2 (t - 1) / t = 1
    assert t2.tensor_parallel_s == pytest.approx(4 * 4 * 4 * 16 * 64 * 2 / 450e9)
    assert math.isclose(
        t2.total_s, sum(v for k, v in t2.as_dict().items() if k.endswith("_s") and k != "total_s")
    )
