"""Read raw rows from JSONL files or the built-in standard-library corpus, with exact locations."""

from __future__ import annotations

import glob
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from ..config import BUILTIN_STDLIB


class DataError(ValueError):
    """Bad input data; the message names the file, the line and what was expected."""


@dataclass(frozen=True)
class Row:
    """One record and where it came from (``file:line``), for error messages."""

    data: dict[str, Any]
    where: str


def iter_rows(specs: str | list[str], max_documents: int | None = None) -> Iterator[Row]:
    """Rows of every source in order; at most ``max_documents`` of them."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    rows = (row for spec in specs for row in _iter_spec(spec))
    return islice(rows, max_documents) if max_documents else rows


def _iter_spec(spec: str) -> Iterator[Row]:
    if spec == BUILTIN_STDLIB:
        yield from iter_stdlib_sources()
        return
    paths = sorted(glob.glob(spec))
    if not paths:
        raise DataError(f"no file matches {spec!r}")
    for path in paths:
        if not path.endswith((".jsonl", ".json")) and Path(path).suffix:
            raise DataError(f"{path}: unsupported file type {Path(path).suffix!r}; this version reads .jsonl files")
        yield from read_jsonl(Path(path))


def read_jsonl(path: Path) -> Iterator[Row]:
    """One JSON object per line; blank lines skipped. Errors name the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON at column {e.colno}: {e.msg}") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
            yield Row(obj, where)


_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "pydoc_data", "encodings"}


def iter_stdlib_sources() -> Iterator[Row]:
    """The standard library's own ``.py`` files as text documents, in a fixed shuffled order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1])
    )
    random.Random(0).shuffle(files)  # fixed order: a mix of modules rather than alphabetical
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield Row({"text": text}, str(path))
