"""The soak's memory trend (scripts/soak_memory.py), by hand: warm-up steps are left out, the
growth compares the medians of the first and last tenth, and the slope is the least-squares one;
a leak of a fixed size per step shows as that slope."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak_memory.py"
spec = importlib.util.spec_from_file_location("soak_memory", SCRIPT)
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def _records(mib_by_step):
    return [
        {"step": s, "split": "train", "memory/current_gib": mib / 1024}
        for s, mib in mib_by_step.items()
    ]


def test_a_flat_run_after_its_warm_up_has_no_growth_and_no_slope():
    # steps 1-10 warm up from 100 to 300 MiB; then 300 MiB with one spike at step 15
    mib = {s: 100 + 20 * s for s in range(1, 11)}
    mib.update({s: 300.0 for s in range(11, 31)})
    mib[15] = 900.0
    trend = soak.memory_trend(_records(mib), warmup_steps=10)
    assert trend["steps"] == 20
    assert trend["first_mib"] == 300.0 and trend["last_mib"] == 300.0  # medians: the spike drops
    assert trend["growth_mib"] == 0.0
    # slope of one 600 MiB spike at step 15 among steps 11..30: 600 (15 - 20.5) / sum((s-20.5)^2)
    spread = sum((s - 20.5) ** 2 for s in range(11, 31))
    assert trend["slope_mib_per_1000_steps"] == pytest.approx(1000 * 600 * (15 - 20.5) / spread)


def test_a_leak_of_half_a_mib_a_step_is_its_slope_and_growth():
    mib = {s: 200 + 0.5 * s for s in range(1, 101)}
    trend = soak.memory_trend(_records(mib), warmup_steps=0)
    assert trend["slope_mib_per_1000_steps"] == pytest.approx(500.0)
    # medians of steps 1-10 (5.5) and 91-100 (95.5): 90 steps apart
    assert trend["growth_mib"] == pytest.approx(45.0)


def test_too_few_steps_after_the_warm_up_is_an_error():
    with pytest.raises(ValueError, match="1 steps after a warm-up of 9"):
        soak.memory_trend(_records({s: 1.0 for s in range(1, 11)}), warmup_steps=9)
