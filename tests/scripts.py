"""The repository's ``scripts/`` from tests: a script file imported as a module (for tests of its
functions), and a shell script run as a user runs it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (registered in ``sys.modules``, so a script
    that imports a sibling by name, and pickling of its functions, find it)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
"""What a launcher (torchrun, srun) sets in its ranks: a command started from a test must not
inherit them, or the script would take itself for a rank of that launch."""


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment as a user's shell would hand it to a launcher: no variables of
    an enclosing launch, one thread per process (the machine has 2 cores), this interpreter as
    ``PYTHON`` (what ``scripts/*.sh`` run); ``extra`` on top."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    return env


def run_script(*args: str, env: dict | None = None, timeout: int = 600):
    """``bash <args>`` (a ``scripts/*.sh`` and its arguments) from the repository root with
    :func:`launcher_env` plus ``env``; the ``subprocess.CompletedProcess`` with text output."""
    return subprocess.run(
        ["bash", *args],
        cwd=ROOT,
        env=launcher_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
