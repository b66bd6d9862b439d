"""The base of every run-config section: unknown keys are errors, assignments are validated, floats are finite.

``allow_inf_nan=False``: every float field refuses ``.inf``, ``-.inf`` and ``.nan`` (and numbers that round to
them, ``1e999``). The ``MAX_*`` bounds cap integer fields far above any real run, so a typo of a few digits
too many is an error before any work, not a run with an ETA of centuries.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MAX_STEPS = 10**9
"""Optimizer steps, and step intervals (eval, log, checkpoint, warmup): a billion steps is years of training."""
MAX_ROWS = 2**20
"""Rows of a micro-batch, micro-batches per step."""
MAX_TOKENS = 2**24
"""Tokens of a row (data.max_length, data.max_target_length), of a sample, of a vocabulary: 16,777,216."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
