"""Inputs a model reads from its config because a training batch does not carry them, settled before training.

X-MOD routes every token through one language adapter per layer, picked by ``lang_ids``; without them (a
trainforge batch has input ids and positions only) it takes ``config.default_language`` and fails when that is
unset. With one language there is one sound choice, written into the config (so ``final/`` and an export reload
with it); with several, which adapter the data needs is the user's call.
"""

from __future__ import annotations

from typing import Any

from ..errors import TrainforgeError


class ModelInputUnknown(TrainforgeError, ValueError):
    """The model needs an input per example (X-MOD's language) that neither the data nor its config gives."""


def settle_inputs(config: Any) -> str | None:
    """Set what ``config`` leaves open and has exactly one sound value for; returns a note of what was set (None
    for nothing). Raises ``ModelInputUnknown`` (exit 2) where the value is the user's choice."""
    languages = getattr(config, "languages", None)
    if not languages or not hasattr(config, "default_language") or config.default_language is not None:
        return None
    languages = list(languages)
    if len(languages) > 1:
        raise ModelInputUnknown(
            f"model: this {getattr(config, 'model_type', 'model')} model has a language adapter for each of "
            f"{', '.join(map(str, languages))} and no default_language to pick one for rows without a language: set "
            "default_language in its config.json (or in model.init) to the language of the training data"
        )
    config.default_language = languages[0]
    return f"model: default_language {languages[0]!r}, the only language of its adapters (written to its config)"
