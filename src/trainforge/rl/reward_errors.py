"""The error of a reward that cannot score (a leaf: the built-ins, the user-function caller and the reward set raise it)."""

from __future__ import annotations

from typing import Any

from ..config.errors import clip, shown
from ..errors import EXIT_BAD_INPUT, TrainforgeError


class RewardError(TrainforgeError):
    """A reward function failed, or a row lacks what a reward reads: the message names the function and the row."""

    exit_code = EXIT_BAD_INPUT


def describe_row(row: dict[str, Any], where: str | None, prompt: str | None = None) -> str:
    """"prompts.jsonl line 12", else the row's own fields, bounded: where a message points at a row."""
    if where:
        return clip(where)
    if prompt is not None:
        return f"the row with prompt {shown(prompt, 120)}"
    return f"the row {shown(row, 200)}"
