"""``--set KEY=VALUE`` overrides: each value parsed as YAML (numbers leniently) and set into the nested config mapping.

A value that is not YAML is taken as its text; one over a limit of ``yaml_text`` (aliases expanded, nesting,
integer digits) is a ``ConfigError`` naming the key. Setting one key of a pair that gives one setting two ways
(``train.max_steps``/``epochs``, ``model.path``/``init``: ``presets.ONE_SETTING``) replaces the other below."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, clip, shown
from .presets import replaced_below
from .yaml_text import MAX_DEPTH, InvalidYaml, load_yaml


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"train.lr=1e-4"`` -> (["train", "lr"], 1e-4). Values are parsed as YAML, numbers leniently."""
    if "=" not in item:
        raise ConfigError(f"--set {shown(item)}: expected KEY=VALUE, for example --set train.max_steps=100")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts) or len(parts) > MAX_DEPTH:
        raise ConfigError(f"--set {shown(item)}: malformed key {shown(key)}")
    try:
        value = load_yaml(raw, f"--set {clip(key.strip())}", lines=False)[0] if raw.strip() else None
    except InvalidYaml:  # not YAML: the text itself (a limit passed is an error)
        value = raw
    if isinstance(value, str):  # YAML reads "1e-4" as a string; users mean a number
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return parts, value


def apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set ``value`` at the key path ``parts`` of ``data``, making the sections on the way."""
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {clip('.'.join(parts))}: {clip('.'.join(parts[: i + 1]))} is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: dict[str, Any], items: list[str] | tuple[str, ...]) -> set[tuple[str, ...]]:
    """Apply ``--set`` items to ``data`` in order; the key paths they set (errors there say "from --set")."""
    overridden: set[tuple[str, ...]] = set()
    for item in items:
        parts, value = parse_override(item)
        section = data.get(parts[0]) if len(parts) == 2 and value is not None else None
        if isinstance(section, dict):  # --set train.max_steps over a file's epochs, model.path over the default's init
            for other in replaced_below(parts[0], {parts[1]}):
                if (parts[0], other) not in overridden:  # both given with --set: validation names the clash
                    section.pop(other, None)
        apply_override(data, parts, value)
        overridden.add(tuple(parts))
    return overridden
