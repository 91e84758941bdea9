"""Walking the exceptions a failure wraps."""

from __future__ import annotations


def exceptions_in(exc: BaseException):
    """``exc`` and every exception it wraps: its cause / context chain and torch DCP's per-rank
    failures (``CheckpointException.failures``), each once."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
