"""Range and choice checks shared by the config sections' ``validate()`` methods.

Each section dataclass (``ParallelConfig``, ``ModelConfig``, ``DataConfig``, ``TrainConfig``, ...)
owns the rules of its own fields; these helpers only give every rule the same message shape,
``train.log_interval=0 must be >= 1``, so a user sees the full dotted key, the value they gave and
the valid range. Imports nothing (the launcher's config check must stay fast).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_range(
    section: str,
    obj: Any,
    name: str,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    why: str = "",
) -> None:
    """``obj.<name>`` lies in [low, high] (``low_open`` / ``high_open``: that end excluded).

    Args:
        section: the config section's name (``train``), for the message.
        optional: None is allowed (and skips the check).
        why: appended to the message (what the value means, what to do).

    Raises:
        ValueError: ``<section>.<name>=<value> must be ...``.
    """
    value = getattr(obj, name)
    if value is None and optional:
        return
    ok = value is not None
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok:
        return
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    rule = " and ".join(parts)
    if optional:
        rule += " (or null)"
    tail = f": {why}" if why else ""
    raise ValueError(f"{section}.{name}={value!r} must be {rule}{tail}")


def check_choice(
    section: str, obj: Any, name: str, choices: Iterable[Any], *, optional: bool = False
) -> None:
    """``obj.<name>`` is one of ``choices`` (or None when ``optional``).

    Raises:
        ValueError: ``<section>.<name>='x'; expected one of a, b, c``.
    """
    value = getattr(obj, name)
    choices = tuple(choices)
    if (value is None and optional) or value in choices:
        return
    listed = ", ".join(str(c) for c in choices) + (", or null" if optional else "")
    raise ValueError(f"{section}.{name}={value!r}; expected one of {listed}")
