"""TP slicing of mapped tensors: hand-checked layouts and exact inverse (no processes)."""

import dataclasses

import pytest
import torch

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures import (
    ARCHITECTURES,
    COLUMN,
    GATE_UP,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    TensorMap,
)
from dpo_megatron.models.conversion.tp_split import merge_tp_shards, read_tp_shard


class DictReader:
    """The slice-reader interface over an in-memory dict (records what was read)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.reads = []

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=0, start=0, stop=None):
        t = self.tensors[name]
        stop = t.shape[dim] if stop is None else stop
        self.reads.append((name, dim, start, stop))
        return t.narrow(dim, start, stop - start).clone() if t.dim() else t.clone()


def _cfg(**kw):
    return dataclasses.replace(ModelConfig(), **kw)


def test_qkv_interleave_by_query_group_hand_checked():
    # 4 query heads, 2 groups, head dim 1, hidden 1: q heads 0..3, k 10/11, v 20/21.
    cfg = _cfg(hidden_size=4, num_attention_heads=4, num_query_groups=2, kv_channels=1)
    tmap = TensorMap("qkv", ("q", "k", "v"), QKV, (("q", "hidden"),) * 3)
    reader = DictReader(
        {
            "q": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
            "k": torch.tensor([[10.0], [11.0]]),
            "v": torch.tensor([[20.0], [21.0]]),
        }
    )
    full = read_tp_shard(tmap, ["q", "k", "v"], reader, cfg, 0, 1, (8, 1))
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    rank1 = read_tp_shard(tmap, ["q", "k", "v"], reader, cfg, 1, 2, (4, 1))
    assert rank1.flatten().tolist() == [2, 3, 11, 21]
    # rank 1 read only its own rows of each tensor
    assert ("q", 0, 2, 4) in reader.reads and ("k", 0, 1, 2) in reader.reads


def test_gate_up_per_rank_hand_checked():
    cfg = _cfg(ffn_hidden_size=4)
    tmap = TensorMap("fc1", ("g", "u"), GATE_UP, (("ffn", "hidden"),) * 2)
    reader = DictReader(
        {"g": torch.arange(4.0).view(4, 1), "u": torch.arange(10.0, 14.0).view(4, 1)}
    )
    assert read_tp_shard(tmap, ["g", "u"], reader, cfg, 0, 2, (4, 1)).flatten().tolist() == [
        0,
        1,
        10,
        11,
    ]
    assert read_tp_shard(tmap, ["g", "u"], reader, cfg, 1, 2, (4, 1)).flatten().tolist() == [
        2,
        3,
        12,
        13,
    ]


def test_gpt2_fused_transposed_qkv_hand_checked():
    # Conv1D stores [in, out]: out columns are q0 q1 | k0 k1 | v0 v1 (2 heads, head dim 1).
    cfg = _cfg(hidden_size=2, num_attention_heads=2, num_query_groups=2, kv_channels=1)
    tmap = TensorMap("qkv", ("c",), QKV, (("qkv", "hidden"),), transposed=True)
    c_attn = torch.tensor(
        [[0.0, 1.0, 10.0, 11.0, 20.0, 21.0], [100.0, 101.0, 110.0, 111.0, 120.0, 121.0]]
    )  # [hidden=2, 6]
    reader = DictReader({"c": c_attn})
    rank0 = read_tp_shard(tmap, ["c"], reader, cfg, 0, 2, (3, 2))
    assert rank0.tolist() == [[0.0, 100.0], [10.0, 110.0], [20.0, 120.0]]  # head 0: q, k, v rows
    rank1 = read_tp_shard(tmap, ["c"], reader, cfg, 1, 2, (3, 2))
    assert torch.equal(merge_tp_shards(tmap, [rank0, rank1], cfg)[0], c_attn)


def test_vocab_padding_rows_are_zero_and_dropped_on_merge():
    cfg = _cfg(vocab_size=5, hidden_size=2)
    tmap = TensorMap("emb", ("e",), VOCAB, (("vocab", "hidden"),))
    emb = torch.arange(10.0).view(5, 2) + 1
    reader = DictReader({"e": emb})
    shards = [read_tp_shard(tmap, ["e"], reader, cfg, r, 2, (3, 2)) for r in range(2)]
    assert shards[1][2].tolist() == [0.0, 0.0]  # padded row 5 of 6
    assert torch.equal(merge_tp_shards(tmap, shards, cfg)[0], emb)


def test_padded_attention_heads_zero_groups():
    # 3 groups of 3 query heads (SmolLM2's ratio) padded to 4 groups at TP 2; head dim 1.
    cfg = _cfg(
        hidden_size=9,
        num_attention_heads=9,
        num_query_groups=3,
        kv_channels=1,
        pad_attention_heads=True,
    )
    qkv = TensorMap(
        "qkv", ("q", "k", "v"), QKV, (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden"))
    )
    proj = TensorMap("proj", ("o",), ROW, (("hidden", "q"),))
    g = torch.Generator().manual_seed(0)
    t = {
        "q": torch.randn(9, 9, generator=g),
        "k": torch.randn(3, 9, generator=g),
        "v": torch.randn(3, 9, generator=g),
        "o": torch.randn(9, 9, generator=g),
    }
    reader = DictReader(t)
    # per rank: 2 groups x (3 + 2) rows; rank 1 holds real group 2 and the zero group 3
    shards = [read_tp_shard(qkv, ["q", "k", "v"], reader, cfg, r, 2, (10, 9)) for r in range(2)]
    assert torch.equal(shards[1][5:], torch.zeros(5, 9))
    assert torch.equal(shards[1][:3], t["q"][6:9])
    merged = merge_tp_shards(qkv, shards, cfg)
    assert all(torch.equal(m, t[n]) for m, n in zip(merged, "qkv"))
    proj_shards = [read_tp_shard(proj, ["o"], reader, cfg, r, 2, (9, 6)) for r in range(2)]
    assert torch.equal(proj_shards[1][:, 3:], torch.zeros(9, 3))
    assert torch.equal(merge_tp_shards(proj, proj_shards, cfg)[0], t["o"])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_table_entry_round_trips_exactly(arch, tp):
    """read_tp_shard on every rank, then merge_tp_shards, gives back every HF tensor bit for bit
    (random values; Qwen2-style q/k/v biases, Qwen3 q/k norms and experts included; an expert's
    tensors are split over the expert-TP ranks, here of the same size)."""
    from dpo_megatron.models.conversion.load import expected_hf_shapes

    moe = arch in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
    mla = {}
    if arch == "deepseek_v3":  # multi-latent attention, a shared expert, the expert score bias
        mla = dict(
            q_lora_rank=12,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=4,
            moe_shared_expert_ffn_hidden_size=16,
            moe_router_score_function="sigmoid",
            moe_router_expert_bias=True,
        )
    cfg = _cfg(
        **mla,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=4,
        vocab_size=50,
        max_position_embeddings=16,
        num_layers=1,
        tie_word_embeddings=False,
        add_qkv_bias=arch == "qwen2",
        add_bias_linear=arch in ("gpt2", "gpt_neox", "gpt_oss"),
        qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        num_experts=4 if moe else None,
        moe_ffn_hidden_size=16 if moe else None,
    )
    table = ARCHITECTURES[arch].tensors(cfg)
    g = torch.Generator().manual_seed(1)
    tensors = {
        n: torch.randn(s, generator=g)
        for n, s in expected_hf_shapes(ARCHITECTURES[arch], cfg).items()
    }
    reader = DictReader(tensors)
    for tmap in table:
        names = [n.replace("{i}", "0").replace("{e}", "3") for n in tmap.hf]
        local = _local_shape(tmap, cfg, tp, reader, names)
        shards = [read_tp_shard(tmap, names, reader, cfg, r, tp, local) for r in range(tp)]
        assert all(tuple(s.shape) == local for s in shards), tmap.megatron
        for name, merged in zip(names, merge_tp_shards(tmap, shards, cfg)):
            assert torch.equal(merged, tensors[name]), (tmap.megatron, name)


def _local_shape(tmap, cfg, tp, reader, names):
    """The per-rank megatron shape of a table entry (what the live parameter would have)."""
    shape = reader.shape(names[0])
    if tmap.transposed and len(shape) == 2:
        shape = shape[::-1]
    if tmap.split == REPLICATED:
        return shape
    if tmap.split in (COLUMN, GATE_UP):
        return (shape[0] * len(names) // tp,) + shape[1:]
    if tmap.split == VOCAB:
        return (-(-shape[0] // tp),) + shape[1:]
    if tmap.split == ROW:
        return (shape[0], shape[1] // tp)
    rows = sum(reader.shape(n)[-1 if tmap.transposed and len(shape) == 2 else 0] for n in names)
    return (rows // tp,) + shape[1:]


def test_transformer_engine_fused_norm_names_map_to_norm_entries():
    """With the TE layer spec the pre-norms live in the next linear layer
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``)."""
    from dpo_megatron.models.conversion.load import table_entry

    arch = ARCHITECTURES["gpt2"]
    cfg = _cfg(add_bias_linear=True)
    table = {t.megatron: t for t in arch.tensors(cfg)}
    layer = "decoder.layers.{i}."
    assert table_entry(
        table, layer + "self_attention.linear_qkv.layer_norm_weight", cfg, arch
    ).hf == ("transformer.h.{i}.ln_1.weight",)
    assert table_entry(table, layer + "mlp.linear_fc1.layer_norm_bias", cfg, arch).hf == (
        "transformer.h.{i}.ln_2.bias",
    )
    with pytest.raises(KeyError, match="decoder.layers.{i}.mlp.router.weight"):
        table_entry(table, layer + "mlp.router.weight", cfg, arch)
