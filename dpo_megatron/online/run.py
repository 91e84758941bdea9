"""Iterative (online) DPO: ``python -m dpo_megatron.online.run --config FILE [k=v ...]``.

One process per rank under torchrun (``scripts/iterative_dpo.sh`` starts them), or a single
process (world size 1). The rounds are :func:`dpo_megatron.online.rounds.run_online`; the
stops end as :mod:`dpo_megatron.train`'s do (one line, the launcher's exit statuses).

``--check``: the launcher's pre-check in one process (the config, the run folder, the prompts
file, the policy against its layout, the reward model's folder); prints the world size the run
needs. ``--check --print-config`` prints the resolved config, ``--check --list-keys`` every key.
"""

from __future__ import annotations

from typing import Optional, Sequence

if __name__ == "__main__":  # first, before torch: glibc reads its malloc tunables at start-up
    from dpo_megatron.parallel.host_malloc import restart_with_malloc_tunables

    restart_with_malloc_tunables()

from dpo_megatron.compat import before_megatron_import  # noqa: E402

before_megatron_import()  # before megatron-core's import (its warnings; no torch.compile on CPU)

import os  # noqa: E402
import sys  # noqa: E402

from dpo_megatron.config import load_config, parse_args  # noqa: E402
from dpo_megatron.online.checks import validate_online_config  # noqa: E402
from dpo_megatron.training.run_dir import RunDirError, check_run_dir  # noqa: E402
from dpo_megatron.utils import ranks  # noqa: E402
from dpo_megatron.utils.exits import FAULT_EXIT, fail  # noqa: E402


def check(argv: Sequence[str]) -> None:
    """The pre-check (one process, no rank started): exits with one ``config error:`` /
    ``error:`` line and status 1 on a mistake, else prints the world size (or the resolved
    config with ``--print-config``, every key with ``--list-keys``)."""
    if "--list-keys" in argv:
        from dpo_megatron.config import list_keys

        try:
            print(list_keys(parse_args([a for a in argv if a != "--list-keys"])[0]))
        except ValueError as e:
            raise SystemExit(f"config error: {e}") from None
        return
    printing = "--print-config" in argv
    config_file, overrides = parse_args([a for a in argv if a != "--print-config"])
    try:
        cfg = load_config(config_file, overrides, check=False)
        if printing:
            validate_online_config(cfg)
            from omegaconf import OmegaConf

            from dpo_megatron.training.resolved_config import resolved_config

            print(OmegaConf.to_yaml(resolved_config(cfg)), end="")
            return
        try:
            check_run_dir(cfg)
        except RunDirError as e:
            raise SystemExit(f"error: {e}") from None
        validate_online_config(cfg)
        world = cfg.parallel.launch_world_size()
        validate_online_config(cfg, world)
    except ValueError as e:
        raise SystemExit(f"config error: {e}") from None
    from dpo_megatron.config import check_model_layout
    from dpo_megatron.data.reader import DataError
    from dpo_megatron.online.prompts import read_prompts

    o = cfg.online
    if o.reward_model.path and not os.path.exists(o.reward_model.path):
        raise SystemExit(
            f"config error: online.reward_model.path={o.reward_model.path} does not exist: "
            "train a reward model first (loss=bradley_terry) or score with online.judge"
        )
    try:
        read_prompts(o.prompts, o.prompts_offset, o.prompts_limit, cfg.data)
        check_model_layout(cfg)
        if o.reward_model.path:
            from dpo_megatron.reward.scoring import reward_model_config

            reward_model_config(o.reward_model.path)  # a reward model, not a causal LM
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"config error: {e}") from None
    print(world)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """One rank of an online run (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--check" in argv:
        check([a for a in argv if a != "--check"])
        return
    config_file, overrides = parse_args(argv)
    try:
        cfg = load_config(config_file, overrides, check=False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cfg.parallel.validate(world)
        if ranks.is_rank0():
            try:
                check_run_dir(cfg)
            except RunDirError as e:
                fail(f"error: {e}")
        validate_online_config(cfg, world)
    except ValueError as e:
        fail(f"config error: {e}")
    from dpo_megatron.checkpointing.integrity import CheckpointIntegrityError
    from dpo_megatron.checkpointing.storage import StorageError
    from dpo_megatron.data.reader import DataError
    from dpo_megatron.online.adapters import JudgeError
    from dpo_megatron.online.rounds import run_online
    from dpo_megatron.parallel import destroy_distributed
    from dpo_megatron.parallel.shutdown import NonFiniteLossError

    try:
        run_online(cfg)
    except (DataError, RunDirError, JudgeError) as e:
        fail(f"error: {e}")
    except (CheckpointIntegrityError, StorageError, NonFiniteLossError) as e:
        fail(f"error: {e}", FAULT_EXIT)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
