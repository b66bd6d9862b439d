"""The user's own reward function, ``function: FILE.py:NAME`` in ``rl.rewards``: loaded from its file when the run
starts, called in a worker thread with a time limit, and its answer checked (one finite number or None per
completion). It runs because the user's config names it (docs/security.md)."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..config.errors import clip, shown
from ..config.rewards import check_function_spec, split_function
from .reward_errors import RewardError, describe_row

_LOADS = itertools.count()  # a fresh module name per load: two versions of a file never share one in sys.modules
_LOADED: dict[tuple[str, int, int], ModuleType] = {}
"""(real path, mtime in ns, size) -> the module: a file is imported once per process while it is unchanged, however
many reward sets name it (the run checks rows with one set and scores with another)."""

RESERVED_FIELDS = ("prompts", "completions")
"""The names of the two positional arguments: a row field so named would clash with them."""


def _where_in(exc: BaseException, path: str) -> str:
    """" at FILE line N" for the deepest frame of ``exc`` in the user's file, else ""."""
    target = os.path.realpath(path)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == target]
    return f" at {clip(path)} line {frames[-1].lineno}" if frames else ""


def _exception_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {clip(str(exc), 300)}" if str(exc) else type(exc).__name__


def _completions(n: int) -> str:
    return "1 completion" if n == 1 else f"{n} completions"


def load_module(path: str) -> ModuleType:
    """Import the Python file at ``path`` (once while it is unchanged); its own directory is on ``sys.path`` while
    its top level runs, so it can import a helper module beside it."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise RewardError(f"rl.rewards: the reward file {clip(path)} cannot be read: {e.strerror}") from None
    key = (real, st.st_mtime_ns, st.st_size)
    if key in _LOADED:
        return _LOADED[key]
    stem = "".join(ch if ch.isalnum() else "_" for ch in os.path.splitext(os.path.basename(path))[0])
    module_name = f"trainforge_user_reward_{next(_LOADS)}_{stem}"
    spec = importlib.util.spec_from_file_location(module_name, real)
    if spec is None or spec.loader is None:
        raise RewardError(f"rl.rewards: {clip(path)} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by name while it runs
    folder = os.path.dirname(real)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit and KeyboardInterrupt from the top level of the user's file too
        del sys.modules[module_name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RewardError(f"rl.rewards: loading the reward file {clip(path)} raised {_exception_text(e)}"
                          f"{_where_in(e, path)}; run `python {clip(path)}` to see the whole error") from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    _LOADED[key] = module
    return module


def _as_score(value: Any) -> float | None:
    """A returned value as a float (None stays None); raise TypeError where it is not a number."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not (hasattr(value, "__float__") or hasattr(value, "__index__")):
        raise TypeError
    return float(value)  # bool, int, float, numpy scalars, 0-d tensors


@dataclass
class UserFunction:
    """``fn(prompts, completions, **row_fields) -> list[float | None]`` from ``spec`` (FILE.py:NAME)."""

    spec: str
    fn: Callable[..., Any]
    timeout_s: float

    @property
    def name(self) -> str:
        return split_function(self.spec)[1]

    @classmethod
    def load(cls, spec: str, timeout_s: float) -> UserFunction:
        """Check ``spec``, import its file and find the function; RewardError (exit 2) where any of it fails."""
        try:
            check_function_spec(spec)
        except ValueError as e:
            raise RewardError(f"rl.rewards: function {shown(spec)}: {e}") from None
        path, name = split_function(spec)
        module = load_module(path)
        fn = getattr(module, name, None)
        if fn is None or not callable(fn):
            defined = sorted(k for k, v in vars(module).items()
                             if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
            what = "does not define" if fn is None else f"defines {name} as a {type(fn).__name__}, not"
            raise RewardError(f"rl.rewards: {clip(path)} {what} a function {name!r}; the functions it defines: "
                              f"{', '.join(defined) or 'none'}; give function: {clip(path)}:NAME with one of them")
        return cls(spec, fn, timeout_s)

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]],
                 where: list[str] | None) -> list[float]:
        """The function's score of each completion, NaN where it returned None; RewardError naming the function and
        the row where it raises, overruns ``timeout_s``, or returns anything but one finite number or None each."""
        keys = list(dict.fromkeys(k for row in rows for k in row))  # every field of every row, first-seen order
        # fresh lists per call: a function that changes its arguments cannot change what the next one sees
        fields = {k: [row.get(k) for row in rows] for k in keys}
        self._check_arguments(prompts, completions, fields, rows, where)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = self.fn(list(prompts), list(completions), **fields)
            except BaseException as e:  # noqa: BLE001 - any failure of the user's code is reported, not raised here
                outcome["error"] = e

        worker = threading.Thread(target=run, name=f"reward {self.name}", daemon=True)  # daemon: a hung one
        worker.start()  # cannot keep the process from exiting after the error
        worker.join(self.timeout_s)
        first = self._row(0, prompts, rows, where) if rows else "an empty batch"
        if worker.is_alive():
            raise RewardError(f"the reward function {self._label} did not return within rl.reward_timeout_s="
                              f"{self.timeout_s:g}s scoring {_completions(len(completions))} (first: {first}); it is "
                              "still running; make it faster, or raise rl.reward_timeout_s")
        if "error" in outcome:
            e = outcome["error"]
            raise RewardError(f"the reward function {self._label} raised {_exception_text(e)}"
                              f"{_where_in(e, split_function(self.spec)[0])} scoring {_completions(len(completions))} "
                              f"(first: {first})")
        return self._checked(outcome.get("value"), prompts, rows, where)

    def _check_arguments(self, prompts: list[str], completions: list[str], fields: dict[str, list[Any]],
                         rows: list[dict[str, Any]], where: list[str] | None) -> None:
        """RewardError where the function's parameters cannot take (prompts, completions, **fields): a missing
        **kwargs is the usual cause, and the message says so rather than showing Python's TypeError alone."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a callable without a readable signature: the call itself will tell
            return
        try:
            signature.bind(prompts, completions, **fields)
        except TypeError as e:
            first = self._row(0, prompts, rows, where) if rows else "an empty batch"
            raise RewardError(f"the reward function {self._label} cannot be called as {self.name}(prompts, completions, "
                              f"**row_fields) with the fields of these rows ({', '.join(fields) or 'none'}; first: "
                              f"{first}): {e}; take the fields you need by name and add **kwargs for the rest") from None

    @property
    def _label(self) -> str:
        path, name = split_function(self.spec)
        return f"{name} ({clip(path)})"

    def _row(self, i: int, prompts: list[str], rows: list[dict[str, Any]], where: list[str] | None) -> str:
        return describe_row(rows[i], where[i] if where else None, prompts[i] if i < len(prompts) else None)

    def _checked(self, value: Any, prompts: list[str], rows: list[dict[str, Any]],
                 where: list[str] | None) -> list[float]:
        n = len(rows)
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
            raise RewardError(f"the reward function {self._label} returned {type(value).__name__} {shown(value, 80)}; "
                              f"return a list of float | None, one per completion ({n} here)")
        if len(value) != n:
            raise RewardError(f"the reward function {self._label} returned {len(value)} values for {_completions(n)} "
                              f"(first: {self._row(0, prompts, rows, where) if n else 'none'}); return one float | "
                              "None per completion, in order")
        scores = []
        for i, item in enumerate(value):
            try:
                score = _as_score(item)
            except (TypeError, ValueError, OverflowError):
                raise RewardError(f"the reward function {self._label} returned {type(item).__name__} {shown(item, 80)} "
                                  f"for completion {i} ({self._row(i, prompts, rows, where)}); return a float, or "
                                  "None for no opinion") from None
            if score is not None and not math.isfinite(score):
                raise RewardError(f"the reward function {self._label} returned {score} for completion {i} "
                                  f"({self._row(i, prompts, rows, where)}); return a finite float, or None for no "
                                  "opinion")
            scores.append(math.nan if score is None else score)
        return scores
