"""The reference DPO repo's command line on this engine (:mod:`dpo_megatron.frontends.dpo_repo`
translates it): ``bash scripts/train_reference_style.sh model=pythia69 datasets=[hh] loss=sft ...``
(``python -m dpo_megatron.frontends.dpo_repo``) prints the equivalent ``scripts/pretrain_dpo.sh`` /
``scripts/pretrain_sft.sh`` command and runs it; ``--dry-run`` prints it only; ``--trl FILE.yaml
[our k=v ...]`` is the ``trl`` command (:mod:`dpo_megatron.cli.trl`). A command that cannot be
translated ends with one ``error:`` line and status 2; a run's own status is the command's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dpo_megatron.cli import command
from dpo_megatron.frontends import dpo_repo


def main(argv: Sequence[str] | None = None) -> int:
    """The command (module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if argv[:1] == ["--trl"]:
        from dpo_megatron.cli import trl

        return trl.main(["--dry-run"] * dry + argv[1:])
    if any(a in ("-h", "--help") for a in argv):
        print(dpo_repo.__doc__)
        return 0
    with command.stops(mistakes=(ValueError,)):  # FrontendError, ArchiveError, our config's
        t = dpo_repo.prepare(argv, dry_run=dry)
    rc = t.run(dry)
    if dry:
        return rc
    if rc == 0:
        print(f"wrote {dpo_repo.write_latest_archive(t.run_dir, t.steps, t.batch_size)}")
    else:  # the engine's messages name its own keys; on this command line they take a prefix
        print(
            "note: an engine key named above (such as data.on_error=skip) goes on this command "
            "line with the prefix engine. (engine.data.on_error=skip)",
            file=sys.stderr,
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
