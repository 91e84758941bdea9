"""Train a policy with a DPO-family loss: ``python -m dpo_megatron.train --config FILE [k=v ...]``.

Runs under torchrun (one process per rank) or as a single process (world size 1). The run is one
:class:`~dpo_megatron.training.trainer.Trainer`: config -> process groups and device -> loss ->
policy and frozen reference -> data -> megatron-core DDP + optimizer -> steps (log, evaluate,
checkpoint) -> final checkpoint.
"""

from __future__ import annotations

from typing import Optional, Sequence

if __name__ == "__main__":  # first, before torch: glibc reads its malloc tunables at start-up
    from dpo_megatron.parallel.host_malloc import restart_with_malloc_tunables

    restart_with_malloc_tunables()

from dpo_megatron.compat.expected_warnings import filter_expected_warnings  # noqa: E402

filter_expected_warnings()  # before megatron-core's import-time warnings

from dpo_megatron.config import DPOConfig, load_config, parse_args  # noqa: E402
from dpo_megatron.launch import fail  # noqa: E402
from dpo_megatron.training.trainer import NonFiniteLossError, Trainer  # noqa: E402


def train(cfg: DPOConfig) -> dict[str, float]:
    """Build the run's :class:`Trainer` and train; returns the last step's metrics.

    Raises:
        NonFiniteLossError: ``train.max_nonfinite_steps`` steps in a row had a NaN/Inf loss or
            gradient (the checkpoints written before are intact).
    """
    return Trainer(cfg).train()


def main(argv: Optional[Sequence[str]] = None) -> None:
    config_file, overrides = parse_args(argv)
    try:
        cfg = load_config(config_file, overrides)
    except ValueError as e:
        fail(f"config error: {e}")
    from dpo_megatron.data.reader import DataError
    from dpo_megatron.parallel import destroy_distributed
    from dpo_megatron.training.run_dir import RunDirError

    try:
        train(cfg)
    # A user's mistake every rank meets (rank 0's data failure and its verdict on the run folder
    # reach every rank): one line, status launch.USER_ERROR_EXIT (the launcher's contract).
    except (DataError, RunDirError) as e:
        fail(f"error: {e}")
    finally:
        destroy_distributed()


__all__ = ["NonFiniteLossError", "Trainer", "main", "train"]

if __name__ == "__main__":
    main()
