"""How a configuration error reads: one line per key, with the value given and where it was set (file and line, or --set).

``ConfigError`` is the error; ``format_errors`` turns pydantic's ``ValidationError`` into its message,
``key_lines`` finds the line of every key of a YAML document. Imports nothing of trainforge but the
error base, so the schema (``config``) and its helpers raise and format without an import circle.

A message never quotes a user's value or key whole: ``shown`` (a bounded repr) and ``clip`` cap each at
``SHOWN_CHARS`` characters without building the full text, and at most ``MAX_ERRORS`` keys are listed.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import TrainforgeError


class ConfigError(TrainforgeError, ValueError):
    """A configuration problem the user can fix; the CLI prints it and exits with code 2."""


SHOWN_CHARS = 200
"""Characters of a user's value (or key, or path) a message quotes at most."""
MAX_ERRORS = 20
"""Keys a validation message lists at most; the rest are counted."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN_CHARS


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters; a huge value is never formatted whole."""
    try:
        text = _REPR.repr(value)
    except Exception:  # an int past Python's digit limit, a value whose repr fails
        text = f"<{type(value).__name__}>"
    return clip(text, limit)


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, the cut marked with "..." and the length."""
    if len(text) <= limit:
        return text
    return f"{text[: max(limit - 30, 10)]}... ({len(text)} characters)"


def key_lines(node: yaml.Node | None, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each key path of a composed YAML document to its 1-based line number (a list item's path ends in
    its index)."""
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            lines[path] = key_node.start_mark.line + 1
            lines.update(key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[prefix + (str(i),)] = item.start_mark.line + 1
            lines.update(key_lines(item, prefix + (str(i),)))
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
    out = [f"invalid configuration ({clip(source)}):"]
    errors = _deepest_union_errors(err.errors(include_input=False, include_url=False), data)
    for e in errors[:MAX_ERRORS]:
        loc = _strip_union_tags(tuple(str(p) for p in e["loc"]), data)
        msg = e["msg"].removeprefix("Value error, ")
        named = _KEY_PREFIX.match(msg)
        if named:  # a validator that knows the exact key names it first: "model.init.x: ..."
            loc, msg = tuple(re.sub(r"\[(\d+)\]", r".\1", named.group(1)).split(".")), named.group(2)  # train[1]: train.1
        key = clip(".".join(loc)) if loc else "(top level)"
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _allowed_keys_hint(schema, loc)
        elif e["type"] == "missing":
            msg = "required key is missing"
        given = _lookup(data, loc)
        where = ""
        # the key, or one above it (train={...}), was --set; or, for an unknown key, one below it (trian.max_steps=3)
        below = e["type"] == "extra_forbidden" and any(o[: len(loc)] == loc for o in overridden)
        if any(loc[:n] in overridden for n in range(1, len(loc) + 1)) or below:
            where = " (from --set)"
        else:
            line = _nearest_line(marks, loc)
            if line:
                where = f" ({clip(source)}, line {line})"
        show = given is not _MISSING and not isinstance(given, dict) and e["type"] != "extra_forbidden"
        given_txt = f"; given {shown(given)}" if show else ""
        out.append(f"  {key}: {clip(msg, 4 * SHOWN_CHARS)}{given_txt}{where}")
    if len(errors) > MAX_ERRORS:
        out.append(f"  ... and {len(errors) - MAX_ERRORS} more")
    return "\n".join(out)


_MISSING = object()
_KEY_PREFIX = re.compile(r"^((?:model|data|train|optim|checkpoint|log)(?:\.[A-Za-z0-9_]+|\[\d+\])+): (.*)$", re.S)


def _strip_union_tags(loc: tuple[str, ...], data: Any) -> tuple[str, ...]:
    """The key path the user typed: without the union member types pydantic adds to locations ("train.str",
    "eval.float", "train.0.SourceSpec.weight"), a CamelCase member being a tag unless the data has such a key."""
    tags = {"str", "float", "int", "bool", "none"}
    kept: list[str] = []
    for p in loc:
        model_tag = p[:1].isupper() and p.isidentifier() and _lookup(data, (*kept, p)) is _MISSING
        if p not in tags and not model_tag and not p.startswith(("function-", "list[", "tuple[", "literal[")):
            kept.append(p)
    return tuple(kept)


def _deepest_union_errors(errors: list[dict[str, Any]], data: Any) -> list[dict[str, Any]]:
    """Without the errors of union members that did not apply: a member's error (its location tagged with the
    member type) is left out when another error lies deeper below the same key, e.g. ``data.train`` "should be
    a valid string" beside ``data.train.0.weight`` "should be greater than 0"."""
    locs = [(tuple(str(p) for p in e["loc"]), _strip_union_tags(tuple(str(p) for p in e["loc"]), data)) for e in errors]

    def explained(raw: tuple[str, ...], loc: tuple[str, ...]) -> bool:
        return raw != loc and any(len(other) > len(loc) and other[: len(loc)] == loc for _, other in locs)

    return [e for e, (raw, loc) in zip(errors, locs) if not explained(raw, loc)]


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
    model, owner = schema, schema  # owner: the model whose list holds a list item's model
    for part in loc[:-1]:
        if part.isdigit():  # a list item: the list's own member model, found below
            continue
        field = model.model_fields.get(part)
        found = model_in(field.annotation) if field else None
        if found is None:
            return ""
        owner, model = model, found
    allowed = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1][:SHOWN_CHARS], allowed, n=1)
    elsewhere = _sections_holding(schema, loc[-1]) if len(loc) == 2 else []
    # a key of the list's owner written in one of its items (data.train[1].max_length): it is set once for all
    of_owner = len(loc) > 3 and loc[-2].isdigit() and loc[-1] in owner.model_fields
    hint = (
        f"; it belongs under {' or '.join(f'{s}.{loc[-1]}' for s in elsewhere)}" if elsewhere else  # train.lr: optim.lr
        f"; it applies to every item of {'.'.join(loc[:-2])}: set {'.'.join(loc[:-3])}.{loc[-1]}" if of_owner else
        f"; Hugging Face's {loc[-1]} is {HF_NAMES[loc[-1]]} here" if loc[-1] in HF_NAMES else
        f"; did you mean {close[0]!r}?" if close else ""
    )
    return f"{hint}{' ' if hint.endswith('?') else '; '}allowed here: {', '.join(allowed)}"


HF_NAMES = {
    "learning_rate": "optim.lr",
    "num_train_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "per_device_eval_batch_size": "train.micro_batch_size (eval batches are as large)",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_checkpointing": "train.activation_checkpointing",
    "max_seq_length": "data.max_length",
    "lr_scheduler_type": "optim.schedule",
    "adam_beta1": "optim.betas", "adam_beta2": "optim.betas", "adam_epsilon": "optim.eps",
    "bf16": "train.precision: bf16", "fp16": "train.precision: fp16", "tf32": "train.precision",
    "torch_compile": "train.compile",
    "logging_steps": "log.every_steps",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep_last",
    "eval_steps": "train.eval_every", "eval_strategy": "train.eval_every", "evaluation_strategy": "train.eval_every",
    "output_dir": "--output DIR on the command line",
    "model_name_or_path": "model.path (a local directory)",
    "dataset_text_field": "data.fields.text",
    "lora_r": "model.lora.r", "lora_alpha": "model.lora.alpha", "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "loss_type": "train.objective",
    "report_to": "log.report_to",
}
"""HF TrainingArguments / TRL / PEFT spellings a user new to trainforge writes, and the key that means the same
here: an unknown key of that name says where to write it (``train.learning_rate``: optim.lr)."""


def _sections_holding(schema: type[BaseModel], key: str) -> list[str]:
    """The top-level sections of ``schema`` that have ``key`` (a key put in the wrong section, as ``train.lr``
    where HF's TrainingArguments hold the learning rate beside the steps)."""
    found = []
    for name, field in schema.model_fields.items():
        section = model_in(field.annotation)
        if section is not None and any((f.alias or n) == key for n, f in section.model_fields.items()):
            found.append(field.alias or name)
    return found


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds: the annotation itself, or the one model among its union members and
    list items (``str | list[str | SourceSpec]``: ``SourceSpec``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = {m for arg in typing.get_args(annotation) if (m := model_in(arg)) is not None}
    return found.pop() if len(found) == 1 else None
