"""Reuse of traced steps within one decision: ``plan`` and a run's set-up trace the same settings more than
once (the long-context levers, then the micro-batch search, then the one-change advice), and a trace of a
deep model costs seconds. Inside ``reusing_traces()`` a trace is computed once per distinct settings;
outside it nothing is kept, so a later call always sees the code and environment of its own moment."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_active: dict[tuple, Any] | None = None


@contextlib.contextmanager
def reusing_traces() -> Iterator[None]:
    """Within this block, a trace of the same settings is computed once (nested blocks share the outer one)."""
    global _active
    outer = _active
    _active = {} if outer is None else outer
    try:
        yield
    finally:
        _active = outer


def remembered(key: tuple, compute: Callable[[], T]) -> T:
    """``compute()``, or what it returned for ``key`` earlier in the enclosing ``reusing_traces`` block."""
    if _active is None:
        return compute()
    if key not in _active:
        _active[key] = compute()
    return _active[key]
