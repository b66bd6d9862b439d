"""One entry of ``rl.rewards``: a built-in reward by ``name``, or the user's own ``function: FILE.py:NAME``,
with its ``weight`` in the weighted sum. The functions themselves run in ``rl/rewards.py``."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Section

BUILTIN_REWARDS = ("final_number", "exact", "regex", "python_syntax", "length")
"""Rewards written in pure Python that ship with trainforge (rl/rewards.py); none executes the completion."""


class RewardSettings(Section):
    name: str | None = Field(None, description=f"a built-in reward: {', '.join(BUILTIN_REWARDS)}")
    function: str | None = Field(
        None, description="FILE.py:NAME, the user's own reward function, called as fn(prompts, completions, **row_fields) "
        "-> list[float | None]; it runs because the config names it (docs/security.md)",
    )
    weight: float = Field(1.0, ge=-1000, le=1000, description="its weight in the summed reward")

    @model_validator(mode="after")
    def _one_of_name_or_function(self) -> RewardSettings:
        if (self.name is None) == (self.function is None):
            raise ValueError("give one of name (a built-in reward) or function (FILE.py:NAME)")
        if self.name is not None and self.name not in BUILTIN_REWARDS:
            raise ValueError(f"unknown reward {self.name!r}; the built-ins are {', '.join(BUILTIN_REWARDS)}")
        return self
