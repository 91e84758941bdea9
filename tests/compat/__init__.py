"""Tests of ``dpo_megatron.compat``: each shows its fault without the patch and its fix with it."""

import subprocess
import sys


def assert_name_error_then_patched(script: str, missing_name: str) -> None:
    """Run ``script`` in a fresh interpreter: its first line of output must be the NameError
    about ``missing_name`` (the fault, before ``enable()``), its last ``patched ok``."""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("NameError") and missing_name in lines[0], lines
    assert lines[-1] == "patched ok"
