"""Iterative (online) DPO: ``python -m dpo_megatron.online.run --config FILE [k=v ...]``.

One process per rank under torchrun (``scripts/iterative_dpo.sh`` starts them), or a single
process (world size 1). The rounds are :func:`dpo_megatron.online.rounds.run_online`; the stops
end as a training run's do (one line, the launcher's exit statuses).

``--check``: the launcher's pre-check in one process (:func:`dpo_megatron.cli.check.precheck`:
the config, the run folder, the prompts file, the policy against its layout, the reward model's
folder); prints the world size the run needs. ``--check --print-config`` prints the resolved
config, ``--check --list-keys`` every key.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from dpo_megatron.cli import check, command
from dpo_megatron.config import check_model_layout, load_config, validate_online_config


def online_checks(cfg, args) -> None:
    """An online run's checks beyond the config: its layouts against the world it will launch,
    the reward model's folder (a reward model, not a causal LM), the prompts file."""
    from dpo_megatron.online.prompts import read_prompts

    validate_online_config(cfg, cfg.parallel.launch_world_size())
    o = cfg.online
    if o.reward_model.path and not os.path.exists(o.reward_model.path):
        raise ValueError(
            f"online.reward_model.path={o.reward_model.path} does not exist: train a reward "
            "model first (loss=bradley_terry) or score with online.judge"
        )
    read_prompts(o.prompts, o.prompts_offset, o.prompts_limit, cfg.data)
    check_model_layout(cfg)
    check_sampling_model_layout(cfg)
    if o.reward_model.path:
        from dpo_megatron.reward.scoring import reward_model_config

        reward_model_config(o.reward_model.path)


def check_sampling_model_layout(cfg) -> None:
    """The architecture against the policy's sampling layout (``online.sampling.parallel``), as
    :func:`check_model_layout` checks it against ``parallel.*``: a sampling pipeline that does
    not split the layers stops here, not on the ranks.

    Raises:
        ValueError: naming the ``online.sampling.parallel.*`` size that conflicts (or the
            ``parallel.*`` one it keeps).
    """
    import dataclasses

    from dpo_megatron.online.layouts import name_sampling_keys, sampling_layout

    layout = sampling_layout(cfg)
    if layout is cfg.parallel:
        return
    try:
        check_model_layout(dataclasses.replace(cfg, parallel=layout))
    except ValueError as e:
        raise ValueError(name_sampling_keys(cfg, str(e))) from None


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of an online run, or with ``--check`` its pre-check (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--check" in argv:
        rest = [a for a in argv if a != "--check"]
        check.precheck(
            rest,
            validate_online_config,
            online_checks,
            weights=False,
            prog="python -m dpo_megatron.online.run --check",
        )
        return
    args = command.parse(command.parser(__doc__, "python -m dpo_megatron.online.run"), argv)
    with command.stops(config=True):
        cfg = load_config(args.config, args.overrides, check=False)
        command.check_start(cfg)
        validate_online_config(cfg, command.world_size())
    from dpo_megatron.online.rounds import run_online

    command.run_in_ranks(run_online, cfg)


if __name__ == "__main__":
    command.start(main, ranks=True)
