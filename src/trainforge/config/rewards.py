"""One entry of ``rl.rewards``: a built-in reward by ``name``, or the user's own ``function: FILE.py:NAME``,
with its ``weight`` in the weighted sum and the keys the built-ins read. The functions themselves run in
``rl/rewards.py``; docs/rewards.md describes each one."""

from __future__ import annotations

import difflib
import os
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import MAX_TOKENS, Section
from .errors import clip, shown

BUILTIN_REWARDS = ("final_number", "exact", "regex", "python_syntax", "length")
"""Rewards written in pure Python that ship with trainforge (rl/rewards.py); none executes the completion."""

READ_BY = {
    "field": ("final_number", "exact"),
    "pattern": ("regex",),
    "target": ("length",),
    "min_length": ("length",),
    "max_length": ("length",),
    "unit": ("length",),
}
"""The keys of an entry that only some built-ins read; any other entry setting one is refused (it would do nothing)."""


def split_function(spec: str) -> tuple[str, str]:
    """``FILE.py:NAME`` -> (FILE.py, NAME), split at the last colon (a Windows drive's colon stays in the path)."""
    path, _, name = spec.rpartition(":")
    return path, name


class RewardSettings(Section):
    name: str | None = Field(None, description=f"a built-in reward: {', '.join(BUILTIN_REWARDS)}")
    function: str | None = Field(
        None, description="FILE.py:NAME, the user's own reward function (the file's path relative to the current "
        "directory), called as fn(prompts, completions, **row_fields) -> list[float | None]; it runs because the config "
        "names it (docs/security.md)",
    )
    weight: float = Field(1.0, ge=-1000, le=1000, description="its weight in the summed reward")
    field: str = Field(
        "answer", min_length=1, description="final_number, exact: the row field that holds the reference answer "
        "(final_number also reads GSM8K's '... #### 42')",
    )
    pattern: str | None = Field(
        None, description="regex (required): a Python regular expression; 1.0 where re.search finds it in the "
        "completion, else 0.0 (inline flags such as (?i) or (?s) work)",
    )
    target: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="length: the ideal length (1.0 there, falling linearly to 0.0 at "
        "0 and at twice the target); the same as min_length = max_length = target",
    )
    min_length: int | None = Field(
        None, ge=0, le=MAX_TOKENS, description="length: shorter completions score length / min_length",
    )
    max_length: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="length: longer completions score 1 - (length - max_length) / "
        "max_length, at least 0.0",
    )
    unit: Literal["chars", "tokens"] = Field(
        "chars", description="length: what a length counts, characters or the model tokenizer's tokens",
    )

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid Python regular expression: {e}; escape literal characters such as "
                                 r"( ) [ ] . * + ? with a backslash (in YAML, quote it with single quotes)") from None
        return v

    @field_validator("function")
    @classmethod
    def _function_file(cls, v: str | None) -> str | None:
        if v is not None:
            check_function_spec(v)
        return v

    @model_validator(mode="after")
    def _one_of_name_or_function(self) -> RewardSettings:
        if (self.name is None) == (self.function is None):
            raise ValueError("give one of name (a built-in reward) or function (FILE.py:NAME)")
        if self.name is not None and self.name not in BUILTIN_REWARDS:
            close = difflib.get_close_matches(self.name, BUILTIN_REWARDS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"unknown reward {shown(self.name)}; {hint}the built-ins are {', '.join(BUILTIN_REWARDS)}; "
                             "for your own, give function: FILE.py:NAME")
        reward = self.name or "a function"
        for key, readers in READ_BY.items():
            # a value equal to the default is no setting: a run's written config.yaml spells every default out
            if key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default \
                    and reward not in readers:
                verb = "reads" if len(readers) == 1 else "read"
                raise ValueError(f"{key} has no effect on {reward} (only {' and '.join(readers)} {verb} it); remove it")
        if self.name == "regex" and self.pattern is None:
            raise ValueError("the regex reward needs pattern: a regular expression, e.g. pattern: '^<think>.*</think>'")
        if self.name == "length":
            self._check_length()
        return self

    def _check_length(self) -> None:
        if self.target is not None and (self.min_length is not None or self.max_length is not None):
            raise ValueError("length: give target, or min_length and/or max_length, not both (target is the same "
                             "as min_length = max_length = target)")
        if self.target is None and self.min_length is None and self.max_length is None:
            raise ValueError("the length reward needs target (an ideal length), or min_length and/or max_length "
                             "(a range that scores 1.0)")
        if self.min_length is not None and self.max_length is not None and self.min_length > self.max_length:
            raise ValueError(f"length: min_length {self.min_length} is above max_length {self.max_length}; swap them")

    def length_range(self) -> tuple[int, int | None]:
        """(lowest, highest) length that scores 1.0; highest None: no upper limit."""
        if self.target is not None:
            return self.target, self.target
        return self.min_length or 0, self.max_length


def check_function_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` is FILE.py:NAME with FILE an existing regular file (nothing is imported)."""
    path, name = split_function(spec)
    if not path or not name:
        raise ValueError("give FILE.py:NAME, the path of a Python file and the name of the function in it, "
                         "e.g. my_rewards.py:score")
    if not name.isidentifier():
        raise ValueError(f"{shown(name)} is not a Python function name; give FILE.py:NAME, e.g. my_rewards.py:score")
    if not path.endswith(".py"):
        raise ValueError(f"{clip(path)} is not a .py file; a reward function is loaded from a Python source file "
                         "(FILE.py:NAME)")
    try:
        found = os.path.isfile(path)
    except (ValueError, OSError):  # a NUL byte, a name too long to look up
        found = False
    if not found:
        where = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"{clip(path)} {where} (relative to the current directory {clip(os.getcwd())}); give the "
                         "path of the Python file that defines the function")
