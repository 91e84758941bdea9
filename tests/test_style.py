"""One style for the whole tree: `ruff format` and `ruff check` (ruff.toml: 100 columns,
absolute imports, sorted imports, pyflakes) pass on every tracked Python file."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["dpo_megatron", "tests", "scripts", "conftest.py", "setup.py"]


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail(
            "ruff is not installed: `pip install -e .[test]` (scripts/setup.sh) installs it"
        )
    return found


def test_the_tree_is_formatted():
    run = subprocess.run(
        [_ruff(), "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_tree_passes_the_linter():
    run = subprocess.run(
        [_ruff(), "check", "--output-format", "concise", *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr


def test_the_linter_bites_on_a_relative_import(tmp_path):
    """The rules are the ones ruff.toml states, not a silent default: a relative import fails."""
    bad = tmp_path / "pkg" / "mod.py"
    bad.parent.mkdir()
    bad.write_text("from .other import thing\n\nprint(thing)\n")
    run = subprocess.run(
        [_ruff(), "check", "--config", str(ROOT / "ruff.toml"), str(bad)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "TID252" in run.stdout, run.stdout
