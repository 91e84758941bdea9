"""The launchers' pre-check: ``python -m dpo_megatron.config --config F [k=v ...]``.

One process, before any rank starts: the config (its assets from the cache), the run folder's
refusals, the data sources (``config.check_data``), the checkpoints it loads or resumes against
the model (``config.check_model_sources``), the model against the layout, its weight files
(``config.check_model_weights``), then the data tokenized into the cache the ranks read
(``config.prepare_data``); it prints the world size the run needs (stdout's last line). With
``WORLD_SIZE`` set (a SLURM job's ranks, ``scripts/slurm/job.sh``) the layout is checked against
it, as the ranks will. On a
CUDA machine one line warns when the layout planner predicts more memory per GPU than the
device has. Every mistake ends the process with one ``config error: ...`` or ``error: ...``
line on stderr and exit status 1. ``--list-keys`` prints every key, ``--print-config`` the
resolved tree; ``--without-weights`` leaves out the weight files and the tokenization, for a
config prepared where the model is not (a preset's architecture is known without its files).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from dpo_megatron import config
from dpo_megatron.cli import command


def precheck(
    argv,
    validate: Callable,
    checks: Callable,
    weights: bool = True,
    prog: str = "python -m dpo_megatron.config",
) -> None:
    """The frame every pre-check shares: ``--list-keys``, ``--print-config`` (``validate``d),
    else the run folder (first: it needs neither torch, the data nor the model), ``validate``,
    ``checks(cfg, args)`` and the world size; ``prog`` is how the pre-check is run (its usage
    line)."""
    from dpo_megatron.utils import collector

    collector.pause()  # a short process: its imports are most of its time
    p = command.parser(__doc__, prog)
    p.add_argument("--list-keys", action="store_true", help="every key: type, default, range")
    p.add_argument("--print-config", action="store_true", help="the resolved config as YAML")
    if weights:
        p.add_argument(
            "--without-weights",
            action="store_true",
            help="check a config where the model's files are not (a job prepared for a "
            "cluster): everything but the weight files and the tokenization",
        )
    args = command.parse(p, argv)
    with command.stops(config=True, launcher=True):
        if args.list_keys:
            print(config.list_keys(args.config))
            return
        cfg = config.load_config(args.config, args.overrides, check=False)
        if args.print_config:
            validate(cfg)
            _print_config(cfg)
            return
        from dpo_megatron.training.run_dir import check_run_dir

        check_run_dir(cfg)
        validate(cfg)
        if "WORLD_SIZE" in os.environ:
            # A launcher that knows the job's ranks before starting them (an allocation:
            # scripts/slurm/job.sh): the layout against them, as every rank will check it.
            cfg.parallel.validate(command.world_size())
        checks(cfg, args)
    print(config.world_size_for(cfg))


def _print_config(cfg) -> None:
    from omegaconf import OmegaConf

    from dpo_megatron.training.resolved_config import resolved_config, unresolved_model_note

    note = unresolved_model_note(cfg)
    if note:
        print(f"# {note}")
    print(OmegaConf.to_yaml(resolved_config(cfg)), end="")


def training_checks(cfg, args) -> None:
    """A training run's checks beyond the config (module docstring); notes go to stderr (the
    launcher reads the world size from stdout's last line)."""
    from dpo_megatron.parallel.host_malloc import mode
    from dpo_megatron.training.run_models import require_sequence_parallel, resolve_model_config

    mode()  # the environment's DPO_MEGATRON_HOST_MALLOC, read again by every rank
    _refuse_flex_training_on_the_host(cfg)
    config.check_data(cfg)  # cheap: no tokenizer, no megatron-core
    config.check_model_sources(cfg, args.config, args.overrides)
    parallel, note = require_sequence_parallel(cfg.parallel, resolve_model_config(cfg))
    _note(note)  # as the ranks will
    config.check_model_layout(dataclasses.replace(cfg, parallel=parallel))
    _note(config.predicted_memory_warning(cfg))
    if not args.without_weights:
        config.check_model_weights(cfg)
        config.prepare_data(cfg)


def _refuse_flex_training_on_the_host(cfg) -> None:
    """``model.local_attention=flex`` attends packed rows with torch's FlexAttention, which has
    no backward on the CPU: refused here in one line, not by every rank at its first step.
    Padded rows (``packing.enabled=false``) and context parallelism (its blockwise kernel
    replaces the local one, docs/ATTENTION.md) do not use it.

    Raises:
        ValueError: flex, packed rows, CP 1 and a gloo (CPU) run together.
    """
    from dpo_megatron.parallel.device import resolve_backend

    if (
        cfg.model.local_attention == "flex"
        and cfg.packing.may_pack()
        and cfg.parallel.context_parallel_size == 1
        and resolve_backend(cfg.parallel.backend) == "gloo"
    ):
        raise ValueError(
            "model.local_attention=flex cannot train on the CPU (torch's FlexAttention has no "
            "CPU backward): use sdpa (or auto) there, or packing.enabled=false"
        )


def _note(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """The pre-check of a training run (module docstring)."""
    precheck(argv, config.validate, training_checks)


if __name__ == "__main__":
    command.start(main, ranks=False)
