"""Tensor-parallel slicing of one mapped tensor, in both directions.

:func:`read_tp_shard` builds the slice a TP rank owns from the HF tensor(s), reading only the
rows or columns it needs. :func:`merge_tp_shards` is its exact inverse: from the slices of all TP
ranks it rebuilds the HF tensor(s), bit for bit (only views, concatenations and transposes).

Layouts follow megatron-core 0.16: ``ColumnParallelLinear`` / ``VocabParallelEmbedding`` split
dim 0 in TP-rank order, ``RowParallelLinear`` splits dim 1, the fused QKV weight of
``SelfAttention`` is ``[ng, (np/ng + 2) * hn, hidden]`` per rank (``get_query_key_value_tensors``)
and the SwiGLU fc1 is ``[gate_r; up_r]`` per rank (``apply_swiglu_sharded_factory``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from dpo_megatron.models.config import ModelConfig
from dpo_megatron.models.conversion.architectures import (
    COLUMN,
    GATE_UP,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    TensorMap,
)


class SliceReader(Protocol):
    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
             ) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


def _attention_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads, query groups, head dim)."""
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    return heads, groups, head_dim


def _read(reader: SliceReader, name: str, transposed: bool, dim: int = 0, start: int = 0,
          stop: int | None = None) -> torch.Tensor:
    """Logical (megatron-orientation) rows/columns [start, stop) along ``dim`` of one HF tensor."""
    if transposed and len(reader.shape(name)) == 2:
        return reader.read(name, 1 - dim, start, stop).t().contiguous()
    return reader.read(name, dim, start, stop)


def read_tp_shard(tmap: TensorMap, hf_names: list[str], reader: SliceReader, cfg: ModelConfig,
                  tp_rank: int, tp_size: int, padded_vocab: int) -> torch.Tensor:
    """This TP rank's slice of the megatron tensor ``tmap.megatron``, read from ``hf_names``.

    Shapes (megatron orientation, per rank): COLUMN [out/tp, ...]; ROW [out, in/tp];
    VOCAB [padded_vocab/tp, hidden] with zero rows past the real vocabulary;
    QKV [ng/tp * (np/ng + 2) * hn, ...]; GATE_UP [2 * ffn/tp, hidden]; REPLICATED unchanged.
    """
    t = tmap.transposed
    if tmap.split == REPLICATED:
        return _read(reader, hf_names[0], t)
    if tmap.split in (COLUMN, ROW):
        dim = 0 if tmap.split == COLUMN else 1
        full = reader.shape(hf_names[0])[(1 - dim) if t and len(reader.shape(hf_names[0])) == 2
                                         else dim]
        per = full // tp_size
        return _read(reader, hf_names[0], t, dim, tp_rank * per, (tp_rank + 1) * per)
    if tmap.split == VOCAB:
        per = padded_vocab // tp_size
        start, stop = tp_rank * per, min((tp_rank + 1) * per, cfg.vocab_size)
        rows = _read(reader, hf_names[0], t, 0, start, max(start, stop))
        if rows.shape[0] < per:  # padding rows: never a real token, zero like megatron's init
            pad = rows.new_zeros((per - rows.shape[0],) + tuple(rows.shape[1:]))
            rows = torch.cat([rows, pad])
        return rows
    if tmap.split == GATE_UP:
        per = cfg.ffn_hidden_size // tp_size
        span = (tp_rank * per, (tp_rank + 1) * per)
        return torch.cat([_read(reader, n, t, 0, *span) for n in hf_names])
    if tmap.split == QKV:
        heads, groups, hd = _attention_dims(cfg)
        q_per_group = heads // groups
        local_groups = groups // tp_size
        g0 = tp_rank * local_groups
        q_span = (g0 * q_per_group * hd, (g0 + local_groups) * q_per_group * hd)
        kv_span = (g0 * hd, (g0 + local_groups) * hd)
        if len(hf_names) == 3:
            q = _read(reader, hf_names[0], t, 0, *q_span)
            k = _read(reader, hf_names[1], t, 0, *kv_span)
            v = _read(reader, hf_names[2], t, 0, *kv_span)
        else:  # one fused [q; k; v] tensor (GPT-2 c_attn)
            q_rows, kv_rows = heads * hd, groups * hd
            q = _read(reader, hf_names[0], t, 0, *q_span)
            k = _read(reader, hf_names[0], t, 0, q_rows + kv_span[0], q_rows + kv_span[1])
            v = _read(reader, hf_names[0], t, 0, q_rows + kv_rows + kv_span[0],
                      q_rows + kv_rows + kv_span[1])
        rest = tuple(q.shape[1:])
        fused = torch.cat([q.reshape(local_groups, q_per_group * hd, *rest),
                           k.reshape(local_groups, hd, *rest),
                           v.reshape(local_groups, hd, *rest)], dim=1)
        return fused.reshape(local_groups * (q_per_group + 2) * hd, *rest)
    raise ValueError(f"{tmap.megatron}: unknown split {tmap.split!r}")


def merge_tp_shards(tmap: TensorMap, shards: list[torch.Tensor], cfg: ModelConfig
                    ) -> list[torch.Tensor]:
    """The HF tensors (stored orientation, in ``tmap.hf`` order) from every TP rank's slice of
    ``tmap.megatron`` (``shards[r]`` from TP rank r). Inverse of :func:`read_tp_shard`; vocab
    padding rows are dropped."""
    if tmap.split == REPLICATED:
        out = [shards[0]]
    elif tmap.split == COLUMN:
        out = [torch.cat(shards, 0)]
    elif tmap.split == ROW:
        out = [torch.cat(shards, 1)]
    elif tmap.split == VOCAB:
        out = [torch.cat(shards, 0)[:cfg.vocab_size]]
    elif tmap.split == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        out = [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    elif tmap.split == QKV:
        heads, groups, hd = _attention_dims(cfg)
        q_per_group = heads // groups
        local_groups = groups // len(shards)
        qs, ks, vs = [], [], []
        for s in shards:
            rest = tuple(s.shape[1:])
            q, k, v = s.reshape(local_groups, (q_per_group + 2) * hd, *rest).split(
                [q_per_group * hd, hd, hd], dim=1)
            qs.append(q.reshape(-1, *rest))
            ks.append(k.reshape(-1, *rest))
            vs.append(v.reshape(-1, *rest))
        out = [torch.cat(qs), torch.cat(ks), torch.cat(vs)]
        if len(tmap.hf) == 1:
            out = [torch.cat(out)]
    else:
        raise ValueError(f"{tmap.megatron}: unknown split {tmap.split!r}")
    if tmap.transposed:
        out = [o.t() if o.dim() == 2 else o for o in out]
    return [o.contiguous() for o in out]
