"""The keys and values of a generation call, kept by the core attention between forwards.

One :class:`KVCache` serves one micro-batch of R rows for the duration of one generation call
(``dpo_megatron.generation``): the prompts are run once (prefill), then one token per row at a
time (decode), and every layer's core attention appends the keys and values of the new slots
and attends to all slots so far. Keys are stored as the core attention receives them, RoPE
already applied at each token's own position (NoPE layers: not rotated), so a decode step never
rotates the cache again.

It reaches the core attention through megatron-core's seam for per-micro-batch attention
inputs, ``packed_seq_params`` (a ``PackedSeqParams`` with ``qkv_format='sbhd'``, which
megatron-core's attention passes through untouched), like packed rows do
(``models.attention.PackedSequenceParams``). Each core attention module owns one entry
(:meth:`KVCache.update`); with pipeline parallelism each rank holds the entries of its own
layers.

Slots: the cache has ``capacity`` slots per row. A forward of n new tokens per row first calls
:meth:`KVCache.append` with their positions and whether each slot holds a real token; rows of
different lengths are left-padded, so every row appends at the same slots, and a padding slot is
never a key of a real query. Query slot i of row r sees key slot j iff j <= i, slot j is real,
its position is at most i's, and (sliding window w) i's position minus j's is at most w; every
slot also sees itself, so a padding query has a key and its output stays finite (nothing reads
it).

A prefill need not compute the padding: :meth:`KVCache.append_packed` takes the same slots but
only their real tokens, packed into one row ([1, T]) with the packed layout they are attended
with (``models.attention.PackedSequenceParams``): row after row, each row's prompt one causal
span, or a token shared by several rows once (``generation.prefix_tree``: a common prefix, whose
keys and values are the same for each row), with the packed token of each real slot; the core
attention attends to them packed and scatters their keys and values into the slots
(:meth:`KVCache.store_packed`). The padding slots keep zero keys that no real query sees.

Storage: each owner's keys and values are [R, groups, capacity, hn], so a decode step reads a
row's slots as a [groups, length, hn] view, the layout a batched matmul takes without a copy
(:meth:`KVCache.row_major`).

megatron-core's own inference context (``megatron.core.inference.contexts.StaticInferenceContext``)
was tried on this stack first: it runs on the CPU for rows of one length, but it stores keys
unrotated and rotates the whole cache with one position table per slot at every decode step, and
masks no padding key (left-padded rows need a dense mask, which the sliding-window kernel does
not take), so the engine keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(eq=False)
class KVCache(PackedSeqParams):
    """Keys and values of one micro-batch of R rows, ``capacity`` slots each (see the module
    docstring). Build with :meth:`create`; call :meth:`append` before each forward. Compared
    and hashed by identity (its fields are tensors)."""

    rows: int = 0
    capacity: int = 0
    positions: torch.Tensor | None = None
    """[R, capacity] int64: each filled slot's position in its row (padding slots: 0)."""
    real: torch.Tensor | None = None
    """[R, capacity] bool: True where a slot holds a token of the row (not padding)."""
    start: int = 0
    """First slot of the forward in progress."""
    length: int = 0
    """Slots filled, the forward in progress included."""
    entries: dict = field(default_factory=dict, repr=False)
    masks: dict = field(default_factory=dict, repr=False)
    packed: PackedSeqParams | None = None
    """The packed layout of the forward in progress (:meth:`append_packed`), else None."""
    packed_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    """[N] row, [N] slot and [N] packed token (None: the i-th) of each real slot of the packed
    forward in progress (:meth:`append_packed`)."""

    # PackedSeqParams compares field by field (tensors here): one cache is one object.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @classmethod
    def create(cls, rows: int, capacity: int, device: torch.device) -> KVCache:
        """An empty cache of ``rows`` rows and ``capacity`` slots on ``device``."""
        return cls(
            qkv_format="sbhd",
            rows=rows,
            capacity=capacity,
            positions=torch.zeros(rows, capacity, dtype=torch.int64, device=device),
            real=torch.zeros(rows, capacity, dtype=torch.bool, device=device),
        )

    def append(self, positions: torch.Tensor, real: torch.Tensor) -> None:
        """Take the next n slots for a forward of n tokens per row.

        Args:
            positions: [R, n] int, each new token's position in its row.
            real: [R, n] bool, False for padding slots.

        Raises:
            ValueError: more slots than ``capacity``, or a shape that is not [R, n].
        """
        if positions.shape != real.shape or positions.shape[0] != self.rows:
            raise ValueError(
                f"KVCache.append takes [rows={self.rows}, n] positions and flags, "
                f"got {tuple(positions.shape)} and {tuple(real.shape)}"
            )
        end = self.length + positions.shape[1]
        if end > self.capacity:
            raise ValueError(f"KVCache holds {self.capacity} slots per row, {end} asked")
        self.positions[:, self.length : end] = positions
        self.real[:, self.length : end] = real
        self.start, self.length = self.length, end
        self.masks = {}
        self.packed = self.packed_slots = None

    def append_packed(
        self,
        positions: torch.Tensor,
        real: torch.Tensor,
        packed: PackedSeqParams,
        token_index: torch.Tensor | None = None,
    ) -> None:
        """Take the next n slots, as :meth:`append`, for a forward of their real tokens only.

        Args:
            positions, real: [R, n] as :meth:`append`.
            packed: the packed layout of the forward's [1, T] tokens (attended with it; its
                ``layout.spans`` must keep a row's tokens from another row's, but for tokens
                the rows share).
            token_index: [N] int64, the packed token of each of the N real slots, row after
                row in slot order (on the cache's device); None: T = N, the i-th real slot's
                token the i-th.

        Raises:
            ValueError: as :meth:`append`, or a ``token_index`` of another length than the
                real slots.
        """
        self.append(positions, real)
        rows, slots = real.nonzero(as_tuple=True)  # row-major
        if token_index is not None and token_index.shape != rows.shape:
            raise ValueError(
                f"KVCache.append_packed: {rows.numel()} real slots, "
                f"token_index of shape {tuple(token_index.shape)}"
            )
        self.packed, self.packed_slots = packed, (rows, slots + self.start, token_index)

    def _entry(self, owner: torch.nn.Module, key: torch.Tensor, value: torch.Tensor):
        """``owner``'s [R, groups, capacity, hn] keys and values (zeros when first met; values
        may be narrower than keys: multi-latent attention)."""
        if owner not in self.entries:
            self.entries[owner] = tuple(
                t.new_zeros((self.rows, t.shape[-2], self.capacity, t.shape[-1]))
                for t in (key, value)
            )
        return self.entries[owner]

    def update(
        self, owner: torch.nn.Module, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``owner``'s keys and values of the new slots; return all its slots so far.

        Args:
            owner: the core attention module (one entry per module).
            key, value: [n, R, groups, hn] of the new slots (megatron-core's layout).

        Returns:
            (keys, values) [length, R, groups, hn], views of the cache.
        """
        keys, values = self._entry(owner, key, value)
        keys[:, :, self.start : self.length] = key.permute(1, 2, 0, 3)
        values[:, :, self.start : self.length] = value.permute(1, 2, 0, 3)
        return tuple(t[:, :, : self.length].permute(2, 0, 1, 3) for t in (keys, values))

    def store_packed(self, owner: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``owner``'s keys and values of a packed forward (:meth:`append_packed`).

        Args:
            key, value: [T, groups, hn], the packed tokens in order.
        """
        keys, values = self._entry(owner, key, value)
        rows, slots, index = self.packed_slots
        if index is not None:  # a shared token fills each of its rows' slots
            key, value = key.index_select(0, index), value.index_select(0, index)
        keys[rows, :, slots] = key
        values[rows, :, slots] = value

    def row_major(self, owner: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``owner``'s keys and values of every slot so far, [R, groups, length, hn] views."""
        return tuple(t[:, :, : self.length] for t in self.entries[owner])

    def visible(self, window: int | None = None) -> torch.Tensor:
        """[R, 1, n, length] bool, True where a new query slot may attend to a key slot (the
        rule of the module docstring); built once per forward and window."""
        if window not in self.masks:
            slots = torch.arange(self.length, device=self.real.device)
            query_slots = slots[self.start :]
            key_pos = self.positions[:, None, : self.length]  # [R, 1, S]
            query_pos = self.positions[:, self.start : self.length, None]  # [R, n, 1]
            seen = (
                self.real[:, None, : self.length]
                & (key_pos <= query_pos)
                & (slots[None, None, :] <= query_slots[None, :, None])
            )
            if window is not None:
                seen &= query_pos - key_pos <= window
            seen |= slots[None, None, :] == query_slots[None, :, None]
            self.masks[window] = seen.unsqueeze(1)
        return self.masks[window]
