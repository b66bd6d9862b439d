"""Markdown reference of every config key, generated from the schema (docs/config.md is its output)."""

from __future__ import annotations

import json
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ..config.errors import model_in
from ..config.run import RunConfig

INTRO = """# Configuration reference

Generated from the schema by `trainforge config --reference`; a test keeps this file equal
to that output. Sections: {sections}. Unknown
keys and invalid values stop a run before any work (exit code 2) with the key, the value
and what is allowed. Override any key on the command line with
`--set section.key=value` (values are read as YAML: `--set optim.lr=1e-4`,
`--set data.eval=null`, `--set model.lora.target_modules=[q_proj,v_proj]`).
Every float must be finite (no `.inf`, `.nan`); integers have the bounds shown. A config file is
UTF-8 YAML of at most 4 MiB; anchors and aliases work up to 100,000 values expanded, 64 levels
of nesting and integers of 100 digits (beyond, exit code 2 naming the file, line and key).
"""


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{json.dumps(field.default)}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    for noise in ("typing.", "pathlib.", "NoneType"):
        text = text.replace(noise, "null" if noise == "NoneType" else "")
    return text.replace("|", "\\|")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{field.alias or name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(_rows(ann, key))
            continue
        extra = []
        for meta in field.metadata:
            for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if getattr(meta, attr, None) is not None:
                    extra.append(f"{sym} {getattr(meta, attr)}")
        desc = (field.description or "") + (f" ({', '.join(extra)})" if extra else "")
        rows.append(f"| `{key}` | {_type(ann)} | {_default(field)} | {desc} |")
        if (item := _list_item_model(ann)) is not None:  # data.train's sources: their keys as data.train[].KEY
            rows.extend(_rows(item, f"{key}[]"))
    return rows


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """The model a list in ``annotation`` holds (``str | list[str | SourceSpec]``: ``SourceSpec``), or None."""
    for arg in (annotation, *get_args(annotation)):
        if get_origin(arg) is list:
            return model_in(arg)
    return None


def config_reference() -> str:
    out = [INTRO.format(sections=", ".join(f"`{f.alias or n}`" for n, f in RunConfig.model_fields.items()))]
    for section, field in RunConfig.model_fields.items():
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):  # a top-level key (preset)
            out.append(f"\n## `{section}`\n\n| key | type | default | meaning |\n|---|---|---|---|")
            out.append(f"| `{section}` | {_type(field.annotation)} | {_default(field)} | {field.description or ''} |")
            continue
        doc = (field.annotation.__doc__ or "").strip()
        out.append(f"\n## `{section}`\n")
        if doc and not doc.startswith("!!!"):
            out.append(doc + "\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        out.extend(_rows(field.annotation, section))
    return "\n".join(out) + "\n"
