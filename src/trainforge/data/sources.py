"""Read raw rows from files (JSONL, JSON, CSV, Parquet, text) or the built-in corpus, with locations.

Rows are streamed: no reader holds a whole file in memory (a JSON array file is the one
exception; its format requires parsing it whole).
"""

from __future__ import annotations

import csv
import glob
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import BUILTIN_FUNCTIONS, BUILTIN_STDLIB

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


class DataError(ValueError):
    """Bad input data; the message names the file, the line (or row) and what was expected."""


@dataclass(frozen=True)
class Row:
    """One record and where it came from (``file:line``), for error messages."""

    data: dict[str, Any]
    where: str


@dataclass
class BadRows:
    """The ``data.on_bad_row`` policy: raise at the first bad row, or skip and count."""

    policy: str = "error"
    count: int = 0
    first: list[str] = field(default_factory=list)

    def report(self, message: str) -> None:
        if self.policy == "error":
            raise DataError(message)
        self.count += 1
        if len(self.first) < 5:
            self.first.append(message)


def expand_paths(spec: str) -> list[Path]:
    """A file, a directory (every supported file below it) or a glob, sorted."""
    p = Path(spec)
    if p.is_dir():
        paths = [q for q in p.rglob("*") if q.is_file() and q.suffix in SUPPORTED_SUFFIXES]
    else:
        paths = [Path(q) for q in glob.glob(spec)]
    if not paths:
        raise DataError(f"no data file matches {spec!r} (supported: {', '.join(SUPPORTED_SUFFIXES)})")
    return sorted(paths)


def iter_source(spec: str, bad: BadRows, txt_mode: str = "file") -> Iterator[Row]:
    """Rows of one source spec (path, directory, glob or the built-in corpus), in a fixed order."""
    if spec in BUILTIN_SOURCES:
        yield from BUILTIN_SOURCES[spec]()
        return
    for path in expand_paths(spec):
        reader = READERS.get(path.suffix)
        if reader is None:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUPPORTED_SUFFIXES)}")
        if path.suffix == ".txt":
            yield from read_txt(path, bad, txt_mode)
        else:
            yield from reader(path, bad)


def read_jsonl(path: Path, bad: BadRows) -> Iterator[Row]:
    """One JSON object per line; blank lines skipped."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.report(f"{where}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                bad.report(f"{where}: malformed JSON at column {e.colno}: {e.msg}")
                continue
            if not isinstance(obj, dict):
                bad.report(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
                continue
            yield Row(obj, where)


def read_json(path: Path, bad: BadRows) -> Iterator[Row]:
    """A JSON array of objects (rows are numbered from 1 in messages)."""
    try:
        items = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON at column {e.colno}: {e.msg}") from None
    if not isinstance(items, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(items).__name__} (use .jsonl for one object per line)")
    for i, obj in enumerate(items, 1):
        if not isinstance(obj, dict):
            bad.report(f"{path}: row {i}: expected a JSON object, got {type(obj).__name__}")
            continue
        yield Row(obj, f"{path}: row {i}")


def read_csv(path: Path, bad: BadRows) -> Iterator[Row]:
    """A header row of field names, then one row per record (``file:line`` counts the header as line 1)."""
    with open(path, newline="", encoding="utf-8", errors="strict") as f:
        reader = csv.DictReader(f)
        try:
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row:  # more cells than header names
                    bad.report(f"{where}: {len(row) - 1 + len(row[None])} cells but the header names {len(reader.fieldnames or [])}")
                    continue
                yield Row(dict(row), where)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: after line {reader.line_num}: not valid UTF-8 (byte {e.start})") from None
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: malformed CSV: {e}") from None


def read_parquet(path: Path, bad: BadRows) -> Iterator[Row]:
    """Parquet, read one record batch at a time (memory bounded by the batch, not the file)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'trainforge[parquet]'") from None
    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for obj in batch.to_pylist():
            n += 1
            yield Row(obj, f"{path}: row {n}")


def read_txt(path: Path, bad: BadRows, mode: str) -> Iterator[Row]:
    """``file``: the whole file is one document; ``paragraph``: each blank-line-separated block is one."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        bad.report(f"{path}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8")
        return
    if mode == "file":
        if text.strip():
            yield Row({"text": text}, str(path))
        return
    lineno, block, start = 0, [], 1
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
        elif block:
            yield Row({"text": "".join(block).rstrip("\n")}, f"{path}:{start}")
            block = []
    if block:
        yield Row({"text": "".join(block).rstrip("\n")}, f"{path}:{start}")


READERS = {".jsonl": read_jsonl, ".json": read_json, ".csv": read_csv, ".parquet": read_parquet, ".txt": read_txt}

_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "pydoc_data", "encodings"}


def iter_python_functions() -> Iterator[Row]:
    """Prompt/completion pairs from the standard library: a documented function's signature and
    docstring as the prompt, its body as the completion. Offline, varied lengths, fixed order."""
    import ast

    files = _stdlib_files()
    random.Random(1).shuffle(files)
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and len(node.body) > 1:
                doc_end = node.body[0].end_lineno
                head = "".join(lines[node.lineno - 1 - len(node.decorator_list) : doc_end])
                body = "".join(lines[doc_end : node.end_lineno])
                if body.strip():
                    yield Row({"prompt": head, "completion": body}, f"{path}:{node.lineno}")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1]))


def iter_stdlib_sources() -> Iterator[Row]:
    """The standard library's own ``.py`` files as text documents, in a fixed shuffled order."""
    files = _stdlib_files()
    random.Random(0).shuffle(files)  # fixed order: a mix of modules rather than alphabetical
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield Row({"text": text}, str(path))


def source_files(spec: str) -> list[Path]:
    """The files a source spec reads (for fingerprinting); the built-in corpus lists its own."""
    return _stdlib_files() if spec in BUILTIN_SOURCES else expand_paths(spec)


BUILTIN_SOURCES = {BUILTIN_STDLIB: iter_stdlib_sources, BUILTIN_FUNCTIONS: iter_python_functions}
