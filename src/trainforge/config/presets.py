"""Presets: named config overlays for the guides' "test vs production" split.

- ``smoke`` proves a config end to end in about a minute: 20 steps on a small share of the data
  (``data.max_documents``), a 2-step warmup, eval on two batches, one checkpoint at the end, nothing
  compiled, a metrics line every step.
- ``production`` is what a long run wants: ``compile: auto``, checkpoints every 30 minutes written
  in the background (``checkpoint.async``), and an eval schedule from the run's length
  (``train.eval_every: auto``: ten evaluations over the run).

Where a preset sits: ``--preset NAME`` on the command line lays it over the config file (and over the
built-in default), beneath ``--set``; ``preset: NAME`` inside a YAML file lays it beneath that file's
own keys. Either way the run's ``config.yaml`` shows every resolved value and the preset's name.
A layer that sets the run's length (``train.max_steps`` or ``train.epochs``), or the model a run starts
from (``model.path`` or ``model.init``), replaces the other one of the layers below it: they are one
setting (``ONE_SETTING``). ``--set`` is such a layer too (config/overrides.py).
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {
        "data": {"max_documents": 200},
        "train": {"max_steps": 20, "compile": False, "eval_every": None, "eval_max_batches": 2},
        "optim": {"warmup_steps": 2},  # a full run's warmup would outlast the 20 steps (and be warned about)
        "checkpoint": {"every_steps": 20, "every_minutes": None},
        "log": {"every_steps": 1},
    },
    "production": {
        "train": {"compile": "auto", "eval_every": "auto"},
        "checkpoint": {"every_minutes": 30.0, "async": True},
    },
}
RUN_LENGTH = ("max_steps", "epochs")
ONE_SETTING: dict[str, tuple[str, ...]] = {"train": RUN_LENGTH, "model": ("path", "init")}
"""Keys of a section that give one setting two ways (the run's length; the model a run starts from): a
layer (a preset, ``--set``) that sets one of them replaces the others of the layers below it."""


def replaced_below(section: str, keys: set[str] | dict[str, object]) -> tuple[str, ...]:
    """The keys of ``section`` a layer setting ``keys`` there replaces (``ONE_SETTING``): the pair's other key."""
    pair = ONE_SETTING.get(section, ())
    return tuple(k for k in pair if k not in keys) if any(k in keys for k in pair) else ()


def preset_overlay(name: str) -> dict[str, Any]:
    """The overlay of preset ``name``; ``ConfigError`` (exit 2) lists the names otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is not known; the presets are: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def overlay(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys laid over it, section by section (a new dict; inputs untouched).
    ``top`` setting one key of a ``ONE_SETTING`` pair removes the other from ``base``'s section."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            for other in replaced_below(key, value):
                out[key].pop(other, None)
            out[key] = overlay(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_presets(data: dict[str, Any], cli_preset: str | None, file_is_user: bool) -> dict[str, Any]:
    """``data`` (a config file's mapping, or the built-in default) with its presets applied: the file's
    own ``preset:`` beneath its keys, then ``cli_preset`` over everything. The result names the preset
    that applies last. ``file_is_user``: False for the built-in default, which any preset overrides."""
    named = data.get("preset")
    if named is not None and not isinstance(named, str):
        raise ConfigError(f"preset: give one name ({', '.join(PRESETS)}), not {type(named).__name__}")
    if named:
        data = overlay(preset_overlay(named), data) if file_is_user else overlay(data, preset_overlay(named))
    if cli_preset:
        data = overlay(data, preset_overlay(cli_preset))
        data["preset"] = cli_preset
    return data
