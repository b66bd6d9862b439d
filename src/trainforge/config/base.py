"""The base of every run-config section: unknown keys are errors, assignments are validated, floats are finite.

``allow_inf_nan=False``: every float field refuses ``.inf``, ``-.inf`` and ``.nan`` (and numbers that round to
them, ``1e999``). The ``MAX_*`` bounds cap integer fields far above any real run, so a typo of a few digits
too many is an error before any work, not a run with an ETA of centuries.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MAX_STEPS = 10**9
"""Optimizer steps, and step intervals (eval, log, checkpoint, warmup): a billion steps is years of training."""
MAX_ROWS = 2**20
"""Rows of a micro-batch, micro-batches per step."""
MAX_TOKENS = 2**24
"""Tokens of a row (data.max_length, data.max_target_length), of a sample, of a vocabulary: 16,777,216."""


def takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits ``true``/``false``: ``bool`` itself, ``Any``, or a union or literal holding one."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(v, bool) for v in get_args(annotation))
    return any(takes_bool(a) for a in get_args(annotation))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads ``true`` as 1 for an int or float field, and YAML reads ``yes``/``on`` as true:
        ``max_steps: yes`` was a 1-step run. A boolean is only a boolean's value."""
        if isinstance(value, bool) and info.field_name and not takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is a boolean (YAML reads yes/no/on/off as booleans too); give a value "
                             "of the key's type")
        return value
