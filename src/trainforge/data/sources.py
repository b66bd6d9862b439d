"""Read raw rows from files (JSONL, JSON, CSV, Parquet, text), datasets saved with
``datasets.Dataset.save_to_disk``, or the built-in corpus, with locations.

Rows are streamed: no reader holds a whole file in memory (a JSON array file is the one
exception; its format requires parsing it whole). Text files are read as UTF-8, a leading
byte-order mark skipped; a file that is not text at all is an error whatever ``on_bad_row`` says.
"""

from __future__ import annotations

import csv
import functools
import glob
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.data import (
    BUILTIN_FUNCTION_LABELS,
    BUILTIN_ARITHMETIC,
    BUILTIN_FUNCTION_PAIRS,
    BUILTIN_FUNCTIONS,
    BUILTIN_STDLIB,
    not_a_data_file,
)
from ..errors import TrainforgeError
from . import textfiles
from .splits import METADATA_FILES, TRAIN, by_split
from .textfiles import (
    GZIP, GZIP_ERRORS, SUPPORTED_SUFFIXES, TEXT_SUFFIXES, bounded_lines, data_suffix, is_data_file, open_data,
    read_whole, strip_bom, text_file_problem,
)

class DataError(TrainforgeError, ValueError):
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
            raise DataError(f"{message} (to skip such rows and count them instead, set data.on_bad_row: skip)")
        self.count += 1
        if len(self.first) < 5:
            self.first.append(message)


def saved_dataset_kind(path: Path) -> str | None:
    """``"dataset"`` for a directory written by ``Dataset.save_to_disk``, ``"dict"`` for one written by
    ``DatasetDict.save_to_disk`` (``dataset_dict.json`` and a directory per split), else None."""
    if (path / "dataset_dict.json").is_file():
        return "dict"
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "dataset"
    return None


def expand_paths(spec: str) -> list[Path]:
    """A file, a directory (every supported file below it) or a glob, sorted.

    A directory saved with ``datasets``' ``save_to_disk`` (at the top or anywhere below) is one
    entry, the directory itself, never the JSON and Arrow files inside it. A directory whose file names
    give two or more splits, as a Hugging Face Hub snapshot's do, gives its ``train`` split (``splits.py``)."""
    p = Path(spec)
    if p.is_dir():
        paths = [p] if saved_dataset_kind(p) else _train_split(p, _files_below(p))
    else:
        paths = [Path(q) for q in glob.glob(spec)]
    if not paths:
        raise DataError(
            f"no data file matches {spec!r} (supported: {', '.join(SUPPORTED_SUFFIXES)}, "
            "or a directory saved with datasets' save_to_disk)"
        )
    for path in paths:
        refuse_special(path)
    return sorted(paths)


def refuse_special(path: Path) -> None:
    """A ``DataError`` for a data file that is no regular file (a FIFO, device or socket), before anything opens it:
    opening a FIFO waits for a writer forever, a device never ends."""
    if what := not_a_data_file(path):
        raise DataError(f"{path} is {what}; give a data file (copy the data into a file first)")


def _files_below(root: Path) -> list[Path]:
    """Supported files below ``root``; a saved dataset below it counts as one entry (its directory)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in list(dirnames):
            if saved_dataset_kind(here / name):
                found.append(here / name)
                dirnames.remove(name)  # its own files are not read one by one
        named = [here / f for f in filenames if is_data_file(Path(f)) and f not in METADATA_FILES]
        for path in named:  # a FIFO named like data would hang the read; a dangling link is skipped as before
            if path.exists():
                refuse_special(path)
        found.extend(path for path in named if path.is_file())
    return found


def _train_split(root: Path, files: list[Path]) -> list[Path]:
    """All ``files`` of ``root``, or only its ``train`` split's when their names give several splits."""
    splits = by_split(root, files)
    named = sorted(s for s in splits if s)
    if len(named) < 2:
        return files
    if TRAIN not in splits:
        # the example names a training-like split (UltraChat's train_sft), not the first in the alphabet (test_gen)
        likely = next((s for s in named if s.startswith(TRAIN)), None) or next(
            (s for s in named if not s.startswith(("test", "val", "eval", "dev"))), named[0])
        example = splits[likely][0].parent / f"{likely}*"
        raise DataError(
            f"{root}: its files are in the splits {', '.join(named)} (as Hugging Face Hub files are named) and none is "
            f"'train'; point data.train at one split's files, e.g. '{example}'"
        )
    return splits[TRAIN]


def iter_source(spec: str, bad: BadRows, txt_mode: str = "file") -> Iterator[Row]:
    """Rows of one source spec (path, directory, glob or the built-in corpus), in a fixed order."""
    if spec in BUILTIN_SOURCES:
        yield from BUILTIN_SOURCES[spec]()
        return
    for path in expand_paths(spec):
        if path.is_dir() and saved_dataset_kind(path):
            yield from read_saved_dataset(path)
            continue
        suffix = data_suffix(path)  # .jsonl for train.jsonl and train.jsonl.gz alike
        reader = READERS.get(suffix) if is_data_file(path) else None
        if reader is None:
            kind = "".join(path.suffixes[-2:]) if path.suffix == GZIP else path.suffix
            raise DataError(
                f"{path}: unsupported file type {kind!r}; use one of {', '.join(SUPPORTED_SUFFIXES)} "
                f"(the text ones also gzip-compressed: .jsonl.gz, .json.gz, .csv.gz, .txt.gz)"
            )
        try:  # the file system's refusals (permissions, a directory named like a file, I/O errors) name the file
            problem = text_file_problem(path) if suffix in TEXT_SUFFIXES else None
            if problem:
                raise DataError(problem)
            if suffix == ".txt":
                yield from read_txt(path, bad, txt_mode)
            else:
                yield from reader(path, bad)
        except GZIP_ERRORS as e:  # before OSError: BadGzipFile is one
            raise DataError(f"{path}: not a complete gzip file ({e or type(e).__name__}); compress it again, or give it uncompressed") from None
        except OSError as e:
            raise DataError(
                f"{path}: cannot be read ({e.strerror or type(e).__name__}); check that it is a file this user may read"
            ) from None


# ---------------------------------------------------------------- text files (data/textfiles.py: names, gzip, UTF-8)

def read_jsonl(path: Path, bad: BadRows) -> Iterator[Row]:
    """One JSON object per line; blank lines skipped."""
    with open_data(path) as f:
        for lineno, raw in enumerate(bounded_lines(f), 1):
            where = f"{path}:{lineno}"
            if raw is None:
                bad.report(f"{where}: the line is over {textfiles.MAX_LINE_BYTES >> 20} MiB, far more than a training row; the file is "
                           "damaged, or holds a whole dataset on one line (write one JSON object per line)")
                continue
            if lineno == 1:
                raw = strip_bom(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.report(f"{where}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue
            # the line without its ending: parsed with it, a row cut off mid-object failed at "column 1" (of the next line)
            line = line.rstrip("\r\n")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                cut = " (the line ends there: is the row cut off?)" if e.pos >= len(line) else ""
                bad.report(f"{where}: malformed JSON at column {e.colno}{cut}: {e.msg}")
                continue
            except RecursionError:  # the parser recurses once per level: thousands of nested brackets
                bad.report(f"{where}: JSON nested too deeply to parse; a row is one object of text fields")
                continue
            if not isinstance(obj, dict):
                bad.report(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
                continue
            yield Row(obj, where)


def read_json(path: Path, bad: BadRows) -> Iterator[Row]:
    """A JSON array of objects (rows are numbered from 1 in messages), or JSON Lines named .json, as
    ``datasets``' ``to_json`` writes them and Hub repositories ship them (read as ``.jsonl``)."""
    if _is_json_lines(path):
        yield from read_jsonl(path, bad)
        return
    try:
        items = json.loads(_whole(path, "a JSON array is parsed whole", "convert it to JSON Lines (one object per line: .jsonl), which is read as it streams").decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON at column {e.colno}: {e.msg}") from None
    except RecursionError:  # the parser recurses once per level: thousands of nested brackets
        raise DataError(f"{path}: JSON nested too deeply to parse; expected an array of row objects") from None
    if not isinstance(items, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(items).__name__} (use .jsonl for one object per line)")
    for i, obj in enumerate(items, 1):
        if not isinstance(obj, dict):
            bad.report(f"{path}: row {i}: expected a JSON object, got {type(obj).__name__}")
            continue
        yield Row(obj, f"{path}: row {i}")


def _whole(path: Path, why: str, fix: str) -> bytes:
    """The file's bytes (decompressed), or a ``DataError`` when they would not fit the memory it may take."""
    raw, limit = read_whole(path)
    if raw is None:
        raise DataError(
            f"{path}: over {limit / 2**30:.1f} GiB{' decompressed' if path.suffix == GZIP else ''}, an eighth of the memory "
            f"available, and {why}; {fix}"
        )
    return raw


def _is_json_lines(path: Path) -> bool:
    """Whether a .json file holds one object per line: its first line is a whole JSON object."""
    with open_data(path) as f:
        first = strip_bom(f.readline(textfiles.MAX_LINE_BYTES)).strip()
    if not first.startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(first), dict)
    except (ValueError, RecursionError):  # a pretty-printed object, or not JSON: read_json says what is wrong
        return False


def read_csv(path: Path, bad: BadRows) -> Iterator[Row]:
    """A header row of field names, then one row per record (``file:line`` counts the header as line 1)."""
    with open_data(path, "rt", newline="", encoding="utf-8-sig", errors="strict") as f:
        reader = csv.DictReader(_csv_lines(f, path))
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


def _csv_lines(f: Any, path: Path) -> Iterator[str]:
    """A CSV file's lines, refused at one over ``MAX_LINE_BYTES`` (a CSV record cannot be skipped from the middle:
    where the next one starts is not known)."""
    for line in bounded_lines(f):
        if line is None:
            raise DataError(f"{path}: a line over {textfiles.MAX_LINE_BYTES >> 20} MiB, far more than a training row; the file is damaged")
        yield line


def read_parquet(path: Path, bad: BadRows) -> Iterator[Row]:
    """Parquet, read one record batch at a time (memory bounded by the batch, not the file)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'trainforge[parquet]'") from None
    n = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for obj in batch.to_pylist():
                n += 1
                yield Row(obj, f"{path}: row {n}")
    except (pa.ArrowException, OSError) as e:
        after = f" (after row {n})" if n else ""
        raise DataError(f"{path} is not a readable Parquet file{after}: {e}") from None


def read_saved_dataset(path: Path, batch_rows: int = 1024) -> Iterator[Row]:
    """A directory saved with ``datasets``' ``save_to_disk``, streamed from its memory-mapped Arrow
    files a batch at a time. A ``DatasetDict`` directory gives its ``train`` split."""
    target, where = saved_dataset_split(path)
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path} is a dataset saved with datasets' save_to_disk; reading it needs the datasets package: "
            "pip install 'trainforge[datasets]'"
        ) from None
    try:
        ds = datasets.load_from_disk(str(target))
    except Exception as e:  # noqa: BLE001 -- missing or corrupt files surface as many error types
        raise DataError(f"{target}: not a readable saved dataset: {type(e).__name__}: {e}") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{target}: expected one dataset, found a {type(ds).__name__}; point at one split's directory")
    n = 0
    for batch in ds.with_format(None).iter(batch_size=batch_rows):
        names = list(batch)
        for values in zip(*(batch[k] for k in names)):
            n += 1
            yield Row(dict(zip(names, values)), f"{where}: row {n}")


def saved_dataset_split(path: Path) -> tuple[Path, str]:
    """The directory of the dataset to read in a saved dataset (a DatasetDict's ``train`` split)
    and how its rows are located in messages."""
    if saved_dataset_kind(path) != "dict":
        return path, str(path)
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        splits = [str(s) for s in splits]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path / 'dataset_dict.json'}: not a readable DatasetDict index ({e})") from None
    if "train" not in splits:
        listed = ", ".join(splits) or "none"
        example = path / (splits[0] if splits else "<split>")
        raise DataError(
            f"{path} is a DatasetDict with no 'train' split (splits: {listed}); "
            f"point at one split's directory, e.g. {example}"
        )
    return path / "train", f"{path} (train split)"


def saved_dataset_files(path: Path) -> list[Path]:
    """The files that hold a saved dataset's rows and layout (its Arrow and JSON files), for fingerprinting."""
    target, _ = saved_dataset_split(path)
    own = [path / "dataset_dict.json"] if target != path else []
    return own + sorted(q for q in target.iterdir() if q.is_file() and q.suffix in (".arrow", ".json"))


def read_txt(path: Path, bad: BadRows, mode: str) -> Iterator[Row]:
    """``file``: the whole file is one document; ``paragraph``: each blank-line-separated block is one."""
    try:
        text = _whole(path, "a text file is read whole", "split it into smaller files").decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads
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


PAIR_MAX_CHARS = 600  # about 200 tokens of a small BPE vocabulary: the whole function fits its half of a row


def iter_python_function_pairs() -> Iterator[Row]:
    """Preference pairs with a known preference, from the same functions: the prompt is the signature and
    docstring, ``chosen`` the real body, ``rejected`` the same lines in reverse order (code that reads
    backwards; a body whose reversal is itself is left out). Only short functions (``PAIR_MAX_CHARS``): both
    sides of a pair share one row, so each side of a 512-token row keeps about 256 tokens."""
    for row in iter_python_functions():
        body = row.data["completion"]
        if len(row.data["prompt"]) + len(body) > PAIR_MAX_CHARS:
            continue
        lines = body.splitlines(keepends=True)
        lines[-1] = lines[-1] if lines[-1].endswith("\n") else lines[-1] + "\n"
        rejected = "".join(reversed(lines))
        if rejected != body:
            yield Row({"prompt": row.data["prompt"], "chosen": body, "rejected": rejected}, row.where)


def iter_python_function_labels() -> Iterator[Row]:
    """Unpaired (KTO) rows with a known preference, from the pair set: every other function's real body as a
    desirable completion (``label: true``), the others' reversed bodies as undesirable ones (TRL's layout)."""
    for k, row in enumerate(iter_python_function_pairs()):
        good = k % 2 == 0
        yield Row({"prompt": row.data["prompt"], "completion": row.data["chosen" if good else "rejected"], "label": good}, row.where)


def _stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (a fresh list: callers shuffle it)."""
    return list(_stdlib_file_list())


@functools.lru_cache(maxsize=1)
def _stdlib_file_list() -> tuple[Path, ...]:
    # listed once per process (a run asks for it to train its tokenizer, tokenize and fingerprint), walking
    # around the skipped directories instead of into them: site-packages alone can hold tens of thousands of files
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _STDLIB_SKIP]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return tuple(sorted(found))


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


ARITHMETIC_MAX = 19  # operands 0..19: 400 sums a model of a few hundred thousand parameters learns on a CPU in minutes


def iter_arithmetic() -> Iterator[Row]:
    """Sums with a checkable answer, in a fixed shuffled order: ``{prompt: "7+12=", completion: "19", answer: "19"}``
    (the completion for SFT, the answer for ``final_number`` under grpo)."""
    pairs = [(a, b) for a in range(ARITHMETIC_MAX + 1) for b in range(ARITHMETIC_MAX + 1)]
    random.Random(3).shuffle(pairs)
    for k, (a, b) in enumerate(pairs):
        yield Row({"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)}, f"{BUILTIN_ARITHMETIC}:{k}")


def source_files(spec: str) -> list[Path]:
    """The files a source spec reads (for fingerprinting); the built-in corpus lists its own, a saved
    dataset its Arrow and JSON files."""
    if spec in BUILTIN_SOURCES:
        return _stdlib_files()
    files = []
    for path in expand_paths(spec):
        files.extend(saved_dataset_files(path) if path.is_dir() and saved_dataset_kind(path) else [path])
    return files


BUILTIN_ROWS_VERSION = 1  # bump when a built-in source yields other rows (it keys the token and tokenizer caches)
BUILTIN_SOURCES = {
    BUILTIN_STDLIB: iter_stdlib_sources, BUILTIN_FUNCTIONS: iter_python_functions, BUILTIN_FUNCTION_PAIRS: iter_python_function_pairs,
    BUILTIN_FUNCTION_LABELS: iter_python_function_labels, BUILTIN_ARITHMETIC: iter_arithmetic,
}
