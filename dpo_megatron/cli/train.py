"""Train a policy with a DPO-family loss: ``python -m dpo_megatron.train --config FILE [k=v ...]``.

Runs under torchrun (one process per rank) or as a single process (world size 1). The run is one
:class:`~dpo_megatron.training.trainer.Trainer`: config -> process groups and device -> loss ->
policy and frozen reference -> data -> megatron-core DDP + optimizer -> steps (log, evaluate,
checkpoint) -> final checkpoint. Every stop ends in one line and a status
(:mod:`dpo_megatron.cli.command`): a mistake (config, layout against the launched world size,
data, run folder) 2, a fault of the run (a checkpoint failing verification, a full or read-only
disk, the NaN stop) 3, SIGINT / SIGTERM 128 + the signal's number after saving.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpo_megatron.cli import command
from dpo_megatron.config import check_model_sources, load_config, validate
from dpo_megatron.utils import collector


def train(cfg) -> dict[str, float]:
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


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of a run (module docstring)."""
    collector.pause()  # until the run is built (train)
    args = command.parse(command.parser(__doc__, "python -m dpo_megatron.train"), argv)
    with command.stops(config=True):
        cfg = load_config(args.config, args.overrides, check=False)
        command.check_start(cfg)
        validate(cfg)
        # what the launcher's pre-check found, for ranks started by another launcher
        check_model_sources(cfg, args.config, args.overrides)
    command.run_in_ranks(train, cfg)


if __name__ == "__main__":
    command.start(main, ranks=True)
