"""Which items (pairs, unpaired examples, SFT rows) each data-parallel rank reads at each
optimizer step (deterministic, resumable)."""

from __future__ import annotations

import numpy as np


class ItemSampler:
    """Global batches of item indices, the same for every parallel layout.

    Epoch e visits the items in ``permutation(num_items)`` drawn from numpy's PCG64 seeded with
    ``seed + e`` (identity order if ``shuffle=False``). Step k of an epoch takes positions
    ``[k*G, (k+1)*G)`` of that order (G = global_batch_size). Data-parallel rank r takes the
    contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of it, split into micro-batches of
    ``micro_batch_size`` items. With ``drop_last`` an epoch has ``num_items // G`` steps;
    without, a last partial batch is completed with the first items of the same epoch's order.

    The state (epoch, step within it) depends on neither the rank nor dp size: a run resumed
    from ``state_dict()``, on any layout, reads exactly the items it had not read.
    """

    def __init__(
        self,
        num_items: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if micro_batch_size < 1 or data_parallel_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"global_batch_size={global_batch_size}, micro_batch_size={micro_batch_size}, "
                f"data_parallel_size={data_parallel_size} must all be >= 1"
            )
        if global_batch_size % (micro_batch_size * data_parallel_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"micro_batch_size={micro_batch_size} x "
                f"data_parallel_size={data_parallel_size}: each rank must get a whole number of "
                "micro-batches"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} not in [0, {data_parallel_size})"
            )
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.step_in_epoch = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.global_batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Pair indices in epoch ``epoch``'s visiting order."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_items)
            else:
                self._order = np.arange(self.num_items)
            self._order_epoch = epoch
        return self._order

    def global_batch(self) -> list[int]:
        """The current step's G pair indices (all ranks), without advancing.

        Raises ValueError when the items cannot fill one global batch (``steps_per_epoch == 0``).
        """
        return self._global_batch(self.epoch, self.step_in_epoch)

    def _global_batch(self, epoch: int, step_in_epoch: int) -> list[int]:
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_items} items cannot fill one global batch of {self.global_batch_size} "
                "items (lower global_batch_size or add data)"
            )
        order = self.epoch_order(epoch)
        start = step_in_epoch * self.global_batch_size
        batch = order[start : start + self.global_batch_size]
        if len(batch) < self.global_batch_size:  # drop_last=False: wrap within the epoch
            batch = np.concatenate([batch, order[: self.global_batch_size - len(batch)]])
        return [int(i) for i in batch]

    def _micro_batches(self, batch: list[int]) -> list[list[int]]:
        """This rank's share of a global batch, split into micro-batches."""
        per_rank = self.global_batch_size // self.data_parallel_size
        mine = batch[self.data_parallel_rank * per_rank : (self.data_parallel_rank + 1) * per_rank]
        m = self.micro_batch_size
        return [mine[i : i + m] for i in range(0, per_rank, m)]

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches (lists of micro_batch_size pair indices) for one step."""
        batch = self.global_batch()
        self.step_in_epoch += 1
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        return self._micro_batches(batch)

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """This rank's micro-batches of every step of epoch ``epoch``, as :meth:`next_step`
        returns them there, without moving the sampler ([] when the items cannot fill one
        global batch)."""
        return [
            self._micro_batches(self._global_batch(epoch, k)) for k in range(self.steps_per_epoch)
        ]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "num_items": self.num_items,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume; ValueError if the state was saved with a different data order definition."""
        state = dict(state)
        if "num_items" not in state and "num_pairs" in state:  # a checkpoint of older versions
            state["num_items"] = state.pop("num_pairs")
        for key in ("seed", "num_items", "global_batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}: "
                    "the resumed run would not see the items it had not seen"
                )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
