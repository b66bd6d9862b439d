"""The rewards of an RL run (``rl.rewards``): built-ins and the user's own functions, each scored on its own and
summed with its weight. None from a function means no opinion on that completion: NaN in its own column, 0 in the
sum (as TRL's nansum). docs/rewards.md describes the built-ins and the contract of a user function."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config.errors import clip, shown
from ..config.rewards import RewardSettings
from .reward_builtins import Builtin, make_builtin
from .reward_errors import RewardError, describe_row
from .user_reward import RESERVED_FIELDS, UserFunction

__all__ = ["RewardError", "RewardScores", "RewardSet"]


@dataclass
class RewardScores:
    """``total``: the weighted sum per completion; ``each``: each reward's raw value per completion (NaN: None)."""

    total: list[float]
    each: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class _Entry:
    name: str
    weight: float
    reward: Builtin | UserFunction


def _unique_names(bases: list[str]) -> list[str]:
    """Each base name once; a repeated one gets _2, _3, ... (skipping a name another entry has as its own)."""
    names: list[str] = []
    for base in bases:
        name, k = base, 2
        while name in names or (name != base and name in bases):
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


class RewardSet:
    """The configured rewards, ready to score batches of completions."""

    def __init__(self, entries: list[_Entry]) -> None:
        self._entries = entries

    @classmethod
    def from_settings(cls, settings: Sequence[RewardSettings], timeout_s: float,
                      count_tokens: Callable[[str], int] | None = None) -> RewardSet:
        """Build the set: user files are imported here, at the start of the run (RewardError, exit 2, where a file
        is missing, fails to import or lacks its function). ``timeout_s`` bounds each call of a user function;
        ``count_tokens`` (text -> its number of tokens) serves ``length`` with ``unit: tokens``."""
        if not settings:
            raise RewardError("rl.rewards is empty; give at least one reward, e.g. - {name: final_number}")
        if not timeout_s > 0 or not math.isfinite(timeout_s):
            raise RewardError(f"rl.reward_timeout_s must be a positive number of seconds; given {timeout_s}")
        rewards: list[Builtin | UserFunction] = []
        for s in settings:
            if s.function is not None:
                rewards.append(UserFunction.load(s.function, timeout_s))
            else:
                rewards.append(make_builtin(s, count_tokens))
        names = _unique_names([r.name for r in rewards])
        return cls([_Entry(n, s.weight, r) for n, s, r in zip(names, settings, rewards)])

    @property
    def names(self) -> list[str]:
        """One unique name per entry, in config order: the built-in's name or the user function's NAME."""
        return [e.name for e in self._entries]

    @property
    def weights(self) -> dict[str, float]:
        return {e.name: e.weight for e in self._entries}

    def describe(self) -> str:
        """One line for the run's start: each reward with its weight, a user function with its file."""
        parts = []
        for e in self._entries:
            label = f"{e.name} ({e.reward.spec.rpartition(':')[0]})" if isinstance(e.reward, UserFunction) else e.name
            parts.append(f"{label} x{e.weight:g}")
        return ", ".join(parts)

    @property
    def required_fields(self) -> set[str]:
        """The row fields the built-ins read (user functions receive every field and check their own)."""
        return {e.reward.field for e in self._entries if isinstance(e.reward, Builtin) and e.reward.field}

    def check_row(self, row: dict[str, Any], where: str) -> None:
        """Raise RewardError naming ``where`` (e.g. "prompts.jsonl line 12") where ``row`` lacks a field a built-in
        reads, holds an answer it cannot compare, or has a field a user function's arguments would clash with."""
        if not isinstance(row, dict):
            raise RewardError(f"{clip(where)}: a prompt row is a JSON object, not {type(row).__name__}")
        for e in self._entries:
            reward = e.reward
            if isinstance(reward, Builtin) and reward.field is not None:
                if row.get(reward.field) is None:
                    fields = ", ".join(shown(k, 40) for k in list(row)[:12]) or "none"
                    raise RewardError(
                        f"{clip(where)}: the {reward.name} reward reads the row field {reward.field!r}, which this row "
                        f"{'has as null' if reward.field in row else 'lacks'} (its fields: {fields}); add it to every "
                        f"row, or set field: in the rl.rewards entry of {reward.name} to the field that holds the answer")
                reward.check_value(row[reward.field], clip(where))
            if isinstance(reward, UserFunction):
                clash = [k for k in RESERVED_FIELDS if k in row]
                if clash:
                    raise RewardError(
                        f"{clip(where)}: the row has a field {clash[0]!r}, the name of an argument of the reward "
                        f"function {reward.name} (fn(prompts, completions, **row_fields)); rename that field")

    def score(self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]],
              where: list[str] | None = None) -> RewardScores:
        """Score each completion (``prompts[i]``, ``rows[i]``: its prompt and prompt row) with every reward;
        ``where`` names each row for messages. RewardError (exit 2) names the function and the row."""
        n = len(completions)
        if len(prompts) != n or len(rows) != n or (where is not None and len(where) != n):
            raise ValueError(f"score: {len(prompts)} prompts, {n} completions, {len(rows)} rows"
                             + (f", {len(where)} locations" if where is not None else "") + "; give one of each per "
                             "completion")
        if any(isinstance(e.reward, Builtin) and e.reward.field for e in self._entries):
            for i, row in enumerate(rows):
                self.check_row(row, describe_row(row, where[i] if where else None, prompts[i]))
        each: dict[str, list[float]] = {}
        for e in self._entries:
            if isinstance(e.reward, UserFunction):
                each[e.name] = e.reward(prompts, completions, rows, where)
            else:
                each[e.name] = e.reward.score(completions, rows)
        total = [math.fsum(e.weight * each[e.name][i] for e in self._entries if not math.isnan(each[e.name][i]))
                 for i in range(n)]
        return RewardScores(total=total, each=each)

