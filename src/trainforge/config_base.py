"""The base of every run-config section: unknown keys are errors, assignments are validated, floats are finite."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `.nan` would pass every gt/ge bound and poison the run
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


MAX_COUNT = 10**9
"""Upper bound of step counts and intervals: a thousand times the longest published training runs; a
larger value is a typo (its ETA would be in geological time)."""
MAX_TOKENS = 2**24
"""Upper bound of a row's tokens (16M): past every model's context."""
