"""How a configuration error reads: one line per key, with the value given and where it was set (file and line, or --set).

``ConfigError`` is the error; ``format_errors`` turns pydantic's ``ValidationError`` into its message,
``key_lines`` finds the line of every key of a YAML document. Imports nothing of trainforge but the
error base, so the schema (``config``) and its helpers raise and format without an import circle.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import TrainforgeError


class ConfigError(TrainforgeError, ValueError):
    """A configuration problem the user can fix; the CLI prints it and exits with code 2."""


class NotYaml(ConfigError):
    """Text that does not parse as YAML (a ``--set`` value then stands for itself)."""


MAX_DEPTH = 64  # a config is four levels deep; model.init and data.fields a few more
SHOWN_CHARS = 200  # a value quoted in a message is cut here: a 120,000-digit number must not become the message


def shown_value(value: Any) -> str:
    """``repr(value)``, cut to ``SHOWN_CHARS`` characters (what an error message may quote of user input)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "<a number too long to show>"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def read_yaml(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    """(data, node tree) of a YAML config; ``where`` names it in errors. Aliases (``*name``) are refused
    before anything is built: ten anchors of ten references each expand to 10^10 values (a YAML bomb),
    and a config never needs them. Values Python cannot hold (an int of 100,000 digits) and nesting past
    the parser's recursion are ConfigErrors too."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # events: aliases seen, never expanded
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(
                    f"{where}, line {event.start_mark.line + 1}: YAML aliases (*{event.anchor[:40]}) are not allowed "
                    "in a trainforge config; write the value out"
                )
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_DEPTH:  # PyYAML's time grows with the square of the depth, its composer recurses
                raise ConfigError(f"{where}, line {event.start_mark.line + 1}: YAML nested more than {MAX_DEPTH} levels deep")
        return yaml.safe_load(text), yaml.compose(text, Loader=yaml.SafeLoader)
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise NotYaml(f"{where}: not valid YAML: {cut(str(e))}") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply to read") from None
    except ValueError as e:  # int("1" * 100_000): past Python's limit for converting digits
        raise ConfigError(f"{where}: a value cannot be read ({cut(str(e))})") from None


def cut(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters (a parser's message quotes the offending line)."""
    return text if len(text) <= limit else text[:limit] + " ..."


def key_lines(node: yaml.Node | None, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each key path of a composed YAML document to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            lines[path] = key_node.start_mark.line + 1
            lines.update(key_lines(value_node, path))
    return lines


def format_errors(
    err: ValidationError,
    data: dict[str, Any],
    source: str,
    marks: dict[tuple[str, ...], int],
    overridden: set[tuple[str, ...]],
    schema: type[BaseModel],
) -> str:
    """The message of a failed validation of ``data`` (read from ``source``) against ``schema``."""
    out = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = _strip_union_tags(tuple(str(p) for p in e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        named = _KEY_PREFIX.match(msg)
        if named:  # a validator that knows the exact key names it first: "model.init.x: ..."
            loc, msg = tuple(named.group(1).split(".")), named.group(2)
        key = ".".join(loc) if loc else "(top level)"
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _allowed_keys_hint(schema, loc)
        elif e["type"] == "missing":
            msg = "required key is missing"
        given = _lookup(data, loc)
        where = ""
        if loc in overridden:
            where = " (from --set)"
        else:
            line = _nearest_line(marks, loc)
            if line:
                where = f" ({source}, line {line})"
        visible = given is not _MISSING and not isinstance(given, dict) and e["type"] != "extra_forbidden"
        given_txt = f"; given {shown_value(given)}" if visible else ""
        out.append(f"  {key}: {msg}{given_txt}{where}")
    return "\n".join(out)


_MISSING = object()
_KEY_PREFIX = re.compile(r"^((?:model|data|train|optim|checkpoint|log)(?:\.[A-Za-z0-9_]+)+): (.*)$", re.S)


def _strip_union_tags(loc: tuple[str, ...]) -> tuple[str, ...]:
    # pydantic adds the union member type to locations ("train.str", "eval.float"); users never typed those
    tags = {"str", "float", "int", "bool", "none"}
    kept = [p for p in loc if p not in tags and not p.startswith(("function-", "list[", "tuple["))]
    return tuple(kept)


def _lookup(data: Any, loc: tuple[str, ...]) -> Any:
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _nearest_line(marks: dict[tuple[str, ...], int], loc: tuple[str, ...]) -> int | None:
    for n in range(len(loc), 0, -1):
        if loc[:n] in marks:
            return marks[loc[:n]]
    return None


def _allowed_keys_hint(schema: type[BaseModel], loc: tuple[str, ...]) -> str:
    model = schema
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        ann = field.annotation if field else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return ""
    allowed = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} allowed here: {', '.join(allowed)}"
