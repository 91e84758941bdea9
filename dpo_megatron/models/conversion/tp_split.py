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
    dims,
)


class SliceReader(Protocol):
    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


def _attention_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads, query groups, head dim)."""
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    head_dim = cfg.kv_channels or cfg.hidden_size // heads
    return heads, groups, head_dim


def _read(
    reader: SliceReader,
    name: str,
    transposed: bool,
    dim: int = 0,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """Logical (megatron-orientation) rows/columns [start, stop) along ``dim`` of one HF tensor."""
    if transposed and len(reader.shape(name)) == 2:
        return reader.read(name, 1 - dim, start, stop).t().contiguous()
    return reader.read(name, dim, start, stop)


def _zero_pad(rows: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``rows`` extended with zeros along ``dim`` to ``size`` (padding: never a real token or
    head; zero like megatron's padded initialisation)."""
    missing = size - rows.shape[dim]
    if missing == 0:
        return rows
    shape = list(rows.shape)
    shape[dim] = missing
    return torch.cat([rows, rows.new_zeros(shape)], dim=dim)


def _read_padded(
    reader: SliceReader, name: str, transposed: bool, dim: int, start: int, stop: int, real: int
) -> torch.Tensor:
    """Logical [start, stop) along ``dim``, where indices >= ``real`` are zero padding."""
    rows = _read(reader, name, transposed, dim, min(start, real), min(stop, real))
    return _zero_pad(rows, dim, stop - start)


def read_tp_shard(
    tmap: TensorMap,
    hf_names: list[str],
    reader: SliceReader,
    cfg: ModelConfig,
    tp_rank: int,
    tp_size: int,
    local_shape: tuple[int, ...],
) -> torch.Tensor:
    """This TP rank's slice of the megatron tensor ``tmap.megatron``, of shape ``local_shape``,
    read from ``hf_names``.

    Shapes (megatron orientation, per rank): COLUMN / VOCAB [out/tp, ...]; ROW [out, in/tp];
    QKV [groups/tp * (np/ng + 2) * hn, ...]; GATE_UP [2 * ffn/tp, hidden] (``tp`` is the
    expert TP size and ``ffn`` the expert width for experts' tensors); REPLICATED unchanged.
    Where the megatron tensor is larger than HF's (vocabulary padded to a multiple of TP; zero
    key/value groups added by ``ModelConfig.pad_attention_heads``) the extra rows, columns or
    groups are zero.
    """
    t = tmap.transposed
    if tmap.split == REPLICATED:
        return _read(reader, hf_names[0], t)
    if tmap.split in (COLUMN, VOCAB, ROW):
        dim = 1 if tmap.split == ROW else 0
        shape = reader.shape(hf_names[0])
        real = shape[(1 - dim) if t and len(shape) == 2 else dim]
        per = local_shape[dim]
        return _read_padded(reader, hf_names[0], t, dim, tp_rank * per, (tp_rank + 1) * per, real)
    if tmap.split == GATE_UP:
        per = local_shape[0] // 2  # [gate_r; up_r]: the dense MLP's or one expert's slice
        span = (tp_rank * per, (tp_rank + 1) * per)
        return torch.cat([_read(reader, n, t, 0, *span) for n in hf_names])
    if tmap.split == QKV:
        heads, groups, hd = _attention_dims(cfg)
        q_per_group = heads // groups
        local_groups = local_shape[0] // ((q_per_group + 2) * hd)
        g0 = tp_rank * local_groups
        g1 = g0 + local_groups
        q_rows, kv_rows = heads * hd, groups * hd
        if len(hf_names) == 3:
            names, offsets = hf_names, (0, 0, 0)
        else:  # one fused [q; k; v] tensor (GPT-2 c_attn)
            names, offsets = hf_names * 3, (0, q_rows, q_rows + kv_rows)
        sizes = (q_per_group * hd, hd, hd)
        lo, hi = min(g0, groups), min(g1, groups)  # real groups; the rest are zero padding
        parts = [
            _zero_pad(
                _read(reader, name, t, 0, offset + lo * size, offset + hi * size),
                0,
                local_groups * size,
            )
            for name, offset, size in zip(names, offsets, sizes)
        ]
        rest = tuple(parts[0].shape[1:])
        fused = torch.cat(
            [p.reshape(local_groups, size, *rest) for p, size in zip(parts, sizes)], dim=1
        )
        return fused.reshape(local_groups * (q_per_group + 2) * hd, *rest)
    raise ValueError(f"{tmap.megatron}: unknown split {tmap.split!r}")


def _hf_size(tmap: TensorMap, dim: int, cfg: ModelConfig) -> int:
    """Size along logical ``dim`` of the (single) HF tensor of ``tmap``."""
    return dims(cfg)[tmap.shapes[0][dim]]


def merge_tp_shards(
    tmap: TensorMap, shards: list[torch.Tensor], cfg: ModelConfig
) -> list[torch.Tensor]:
    """The HF tensors (stored orientation, in ``tmap.hf`` order) from every TP rank's slice of
    ``tmap.megatron`` (``shards[r]`` from TP rank r). Inverse of :func:`read_tp_shard`; vocab
    padding rows and padded (zero) attention heads are dropped."""
    if tmap.split == REPLICATED:
        out = [shards[0]]
    elif tmap.split in (COLUMN, VOCAB):
        out = [torch.cat(shards, 0)[: _hf_size(tmap, 0, cfg)]]
    elif tmap.split == ROW:
        out = [torch.cat(shards, 1)[:, : _hf_size(tmap, 1, cfg)]]
    elif tmap.split == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        out = [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    elif tmap.split == QKV:
        heads, groups, hd = _attention_dims(cfg)
        q_per_group = heads // groups
        local_groups = shards[0].shape[0] // ((q_per_group + 2) * hd)
        qs, ks, vs = [], [], []
        for s in shards:
            rest = tuple(s.shape[1:])
            q, k, v = s.reshape(local_groups, (q_per_group + 2) * hd, *rest).split(
                [q_per_group * hd, hd, hd], dim=1
            )
            qs.append(q.reshape(-1, *rest))
            ks.append(k.reshape(-1, *rest))
            vs.append(v.reshape(-1, *rest))
        # Zero groups added by head padding come after the real ones: drop them.
        out = [
            torch.cat(qs)[: groups * q_per_group * hd],
            torch.cat(ks)[: groups * hd],
            torch.cat(vs)[: groups * hd],
        ]
        if len(tmap.hf) == 1:
            out = [torch.cat(out)]
    else:
        raise ValueError(f"{tmap.megatron}: unknown split {tmap.split!r}")
    if tmap.transposed:
        out = [o.t() if o.dim() == 2 else o for o in out]
    return [o.contiguous() for o in out]
