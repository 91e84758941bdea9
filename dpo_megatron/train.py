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

from dpo_megatron.compat import before_megatron_import  # noqa: E402

before_megatron_import()  # before megatron-core's import (its warnings; no torch.compile on CPU)

import os  # noqa: E402

from dpo_megatron.config import (  # noqa: E402
    DPOConfig,
    check_model_sources,
    load_config,
    parse_args,
    validate,
)
from dpo_megatron.parallel.shutdown import (  # noqa: E402
    NonFiniteLossError,
    broken_collectives_end_a_stopping_rank,
)
from dpo_megatron.training.run_dir import RunDirError, check_run_dir  # noqa: E402
from dpo_megatron.utils import collector, ranks  # noqa: E402
from dpo_megatron.utils.exits import FAULT_EXIT, fail  # noqa: E402


def train(cfg: DPOConfig) -> dict[str, float]:
    """Build the run's :class:`~dpo_megatron.training.trainer.Trainer` and train; returns the
    last step's metrics.

    Raises:
        NonFiniteLossError: ``train.max_nonfinite_steps`` steps in a row had a NaN/Inf loss or
            gradient (the checkpoints written before are intact).
    """
    from dpo_megatron.training.trainer import Trainer

    trainer = Trainer(cfg)
    # What is built by now (modules, models, the tokenized data) lives for the whole run.
    collector.resume_after_setup()
    return trainer.train()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """One rank of a run. Every stop found here ends in one line and a status
    (:mod:`dpo_megatron.launch`): a mistake (config, layout against the launched world size,
    data, run folder) with ``USER_ERROR_EXIT``, a fault of the run (a checkpoint failing
    verification, a full or read-only disk met by a save, the logs or the run folder, the NaN
    stop) with ``FAULT_EXIT``, SIGINT / SIGTERM with
    128 + the signal's number after saving."""
    collector.pause()  # until the run is built (train)
    config_file, overrides = parse_args(argv)
    try:
        cfg = load_config(config_file, overrides, check=False)
        # Before the heavy imports (torch, megatron-core), so that these stop in seconds: the
        # layout against the ranks launched (torchrun's WORLD_SIZE; 1 alone: an external
        # torchrun with the wrong --nproc-per-node), then the run folder's refusals (rank 0).
        cfg.parallel.validate(int(os.environ.get("WORLD_SIZE", "1")))
        if ranks.is_rank0():
            try:
                check_run_dir(cfg)
            except RunDirError as e:
                fail(f"error: {e}")
        validate(cfg)
    except ValueError as e:
        fail(f"config error: {e}")
    try:  # what the launcher's pre-check found, for ranks started by another launcher
        check_model_sources(cfg, config_file, overrides)
    except (OSError, ValueError) as e:
        fail(f"config error: {e}")
    from dpo_megatron.checkpointing.integrity import CheckpointIntegrityError
    from dpo_megatron.checkpointing.storage import StorageError
    from dpo_megatron.data.reader import DataError
    from dpo_megatron.parallel import destroy_distributed

    try:
        with broken_collectives_end_a_stopping_rank():
            train(cfg)
    # A user's mistake every rank meets (rank 0's data failure and its verdict on the run folder
    # reach every rank): one line, status launch.USER_ERROR_EXIT (the launcher's contract).
    except (DataError, RunDirError) as e:
        fail(f"error: {e}")
    # A fault every rank meets (the checks and the save are collective, rank 0's failed log
    # writes are agreed at the step boundary, the NaN count is the same everywhere): its
    # message names the file or step and the last good checkpoint.
    except (CheckpointIntegrityError, StorageError, NonFiniteLossError) as e:
        fail(f"error: {e}", FAULT_EXIT)
    finally:
        destroy_distributed()


__all__ = ["NonFiniteLossError", "main", "train"]

if __name__ == "__main__":
    main()
