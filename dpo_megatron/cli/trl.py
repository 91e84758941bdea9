"""A TRL ``DPOConfig`` YAML on this engine (:mod:`dpo_megatron.frontends.trl` translates it):
``python -m dpo_megatron.cli.trl [--dry-run] FILE.yaml [our key=value ...]`` (also
``scripts/train_reference_style.sh --trl FILE.yaml ...``) prints the equivalent
``scripts/pretrain_dpo.sh`` command on ``configs/from_trl_base.yaml`` and runs it (docs/
COMING_FROM.md, "TRL"). A file that cannot be translated ends with one ``error:`` line and
status 2; a run's own status is the command's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dpo_megatron.cli import command
from dpo_megatron.frontends.common import FrontendError
from dpo_megatron.frontends.dpo_repo import prepare_trl_command


def main(argv: Sequence[str] | None = None) -> int:
    """The command (module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    dry = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    with command.stops(mistakes=(ValueError,)):  # FrontendError, our config's
        if not argv:
            raise FrontendError("--trl needs the path of a TRL DPOConfig YAML")
        t = prepare_trl_command(argv[0], argv[1:])
    return t.run(dry)


if __name__ == "__main__":
    sys.exit(main())
