"""Resumable tokenizing of a corpus of many files: a unit of work per file (a shard), kept as it finishes.

A cache entry whose training sources hold two or more files is tokenized file by file. Each finished
file's tokens are published as a small store in ``CACHE/data/.KEY.units/unit-NNNNN`` (an atomic rename),
then the manifest ``manifest.json`` there is rewritten atomically to list it, with the file's path, size
and modification time and the entry's key (which covers the tokenizer, the format, every setting and the
sources' bytes). A prepare that was killed and is run again reuses every listed unit whose file is
unchanged, tokenizes the rest, and joins the units, in order, into the entry's store: the same bytes an
uninterrupted prepare writes. The entry itself is still published whole and atomically
(``cache.publish_entry``); the units directory is removed once it is.

Rows are tokenized in chunks that never span two files: the stored tokens equal those of one stream
(each row is tokenized on its own), except KTO's, whose KL samples pair rows within a chunk: those
builds, ``max_documents`` (a row budget across files) and the built-in corpus stay one stream.
"""

from __future__ import annotations

import glob
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.data import DataSettings
from ..rundir.atomic import atomic_write_text, publish_dir, remove_stale_temps
from .sources import BUILTIN_SOURCES, BadRows, Row, expand_paths, iter_source
from .store import StoreWriter, TokenStore

UNITS_VERSION = 1  # bump when a unit's store or the manifest changes
MANIFEST = "manifest.json"
STALE_UNIT_S = 2 * 3600  # a unit temporary of another host is left over after this long unchanged
_COPY_TOKENS = 1 << 24  # tokens copied per slice when joining units: bounded memory


@dataclass(frozen=True)
class Unit:
    """One file of the training source ``source``."""

    index: int
    source: int
    path: Path


def shard_units(cfg: DataSettings, fmt: str) -> list[Unit] | None:
    """The files of the training sources as units of work, or None where the build stays one stream (one file,
    the built-in corpus, ``max_documents``, KTO rows)."""
    if cfg.max_documents or fmt == "unpaired":
        return None
    units: list[Unit] = []
    for k, spec in enumerate(cfg.sources()):
        if spec.path in BUILTIN_SOURCES:
            return None
        units += [Unit(len(units) + i, k, p) for i, p in enumerate(expand_paths(spec.path))]
    return units if len(units) >= 2 else None


def file_identity(path: Path) -> dict[str, Any]:
    """What a finished unit is checked against on reuse: the file's absolute path, size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def units_dir(root: Path) -> Path:
    """Where the finished units of the entry ``root`` wait: ``.KEY.units`` beside it (hidden; not a temporary)."""
    return root.parent / f".{root.name}.units"


def unit_rows(unit: Unit, bad: BadRows, txt_mode: str) -> Iterator[Row]:
    """The rows of one unit's file, as ``iter_source`` reads them within its source."""
    return iter_source(glob.escape(str(unit.path)), bad, txt_mode)


def merge_bad(into: BadRows, part: BadRows) -> None:
    """Add a unit's skipped bad rows to the build's, in order (the first five messages kept)."""
    into.count += part.count
    into.first = (into.first + part.first)[:5]


# tokenize(rows, writer, bad) -> the unit's counts (a dict of numbers); it writes the unit's sequences to writer
# and reports the rows it cannot render to bad
TokenizeUnit = Callable[[Iterator[Row], StoreWriter, BadRows], dict[str, Any]]
# keep(row, source) -> whether the row trains (the hold-out sorts it); None: every row trains, no replay needed
KeepRow = Callable[[Row, int], bool]


class ShardStage:
    """The finished units of one cache entry, and the manifest that lists them."""

    def __init__(self, root: Path, units: list[Unit], log: Callable[[str], None] = print):
        self.root, self.units, self.log = Path(root), units, log
        self.dir = units_dir(self.root)
        self.manifest_path = self.dir / MANIFEST
        self.key = {"v": UNITS_VERSION, "entry": self.root.name}

    def _load(self) -> dict[int, dict[str, Any]]:
        """The manifest's units that can be reused: same key, same file, their store in place."""
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, ValueError):
            return {}
        if manifest.get("key") != self.key:
            return {}
        done = {}
        for entry in manifest.get("units", []):
            i = entry.get("index")
            if not isinstance(i, int) or not 0 <= i < len(self.units):
                continue
            unit = self.units[i]
            try:
                same = entry.get("file") == file_identity(unit.path) and entry.get("source") == unit.source
            except OSError:
                same = False
            if same and (self._unit_path(i) / "meta.json").is_file():
                done[i] = entry
        return done

    def _unit_path(self, i: int) -> Path:
        return self.dir / f"unit-{i:05d}"

    def _save(self, done: dict[int, dict[str, Any]]) -> None:
        body = {"key": self.key, "units_total": len(self.units), "units": [done[i] for i in sorted(done)]}
        atomic_write_text(self.manifest_path, json.dumps(body, indent=1))

    def write(self, out: Path, vocab: int, n_sources: int, tokenize: TokenizeUnit, bad: BadRows, txt_mode: str,
              keep: KeepRow | None) -> list[dict[str, Any]]:
        """The training store at ``out`` from every unit, reusing finished ones; returns each unit's counts.
        ``keep``: the hold-out, replayed over a reused unit's rows (it spills held-out rows, counts eval copies)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.dir, STALE_UNIT_S)  # units a killed prepare was writing
        done = self._load()
        if done:
            self.log(f"data: resuming: reusing {len(done)} of {len(self.units)} shards tokenized before ({self.dir})")
        progress = Progress(self.units, done, self.log)
        for unit in self.units:
            if unit.index in done:
                entry = done[unit.index]
                if keep is not None:
                    for row in unit_rows(unit, BadRows("skip"), txt_mode):
                        keep(row, unit.source)
                part = BadRows(bad.policy, entry["bad_count"], list(entry["bad_first"]))
            else:
                part = BadRows(bad.policy)
                entry = self._tokenize(unit, tokenize, part, txt_mode, keep, vocab)
                done[unit.index] = entry
                self._save(done)
                progress.finished(unit, entry["counts"].get("tokens", 0))
            merge_bad(bad, part)
        self._join(out, vocab, n_sources)
        return [done[u.index]["counts"] for u in self.units]

    def _tokenize(self, unit: Unit, tokenize: TokenizeUnit, bad: BadRows, txt_mode: str, keep: KeepRow | None,
                  vocab: int) -> dict[str, Any]:
        identity = file_identity(unit.path)  # before reading: a file changed while read is not reused later
        rows = unit_rows(unit, bad, txt_mode)
        kept = rows if keep is None else (row for row in rows if keep(row, unit.source))
        counts: dict[str, Any] = {}

        def build(tmp: Path) -> None:
            writer = StoreWriter(tmp, vocab)
            writer.start_source()
            counts.update(tokenize(kept, writer, bad))
            writer.close({"rows": counts.get("rows", 0)})

        # the same tokens whoever writes them: when another prepare of this entry published the unit first, its copy stays
        publish_dir(self._unit_path(unit.index), build, lambda p: (p / "meta.json").is_file())
        return {"index": unit.index, "source": unit.source, "file": identity, "counts": counts,
                "bad_count": bad.count, "bad_first": bad.first}

    def _join(self, out: Path, vocab: int, n_sources: int) -> None:
        """The units' stores, in order, as one store of ``n_sources`` sources (a source with no file stays empty)."""
        writer = StoreWriter(out, vocab)
        rows = 0
        for k in range(n_sources):
            writer.start_source()
            for unit in (u for u in self.units if u.source == k):
                store = TokenStore(self._unit_path(unit.index))
                rows += int(store.meta.get("rows", 0))
                lengths = store.lengths
                for i, j in store.slices(_COPY_TOKENS):
                    ids, learn = store.read(int(store.offsets[i]), int(store.offsets[j]))
                    desirable = None if store.desirable is None else store.desirable[i:j]
                    writer.append(ids, learn, lengths[i:j], store.continues[i:j], desirable)
                del store  # its memory maps close before the next unit opens
        writer.close({"rows": rows})

    def remove(self) -> None:
        """Drop the units once the entry is published (or was found complete)."""
        shutil.rmtree(self.dir, ignore_errors=True)


class Progress:
    """A console line per finished shard: how far (by bytes of the files), tokens/s and the time left."""

    def __init__(self, units: list[Unit], done: dict[int, Any], log: Callable[[str], None]):
        self.sizes = {u.index: _size(u.path) for u in units}
        self.total_bytes = max(1, sum(self.sizes.values()))
        self.done_bytes = sum(self.sizes[i] for i in done)
        self.start, self.tokens, self.bytes_now, self.log = time.perf_counter(), 0, 0, log
        self.n, self.finished_n = len(units), len(done)

    def finished(self, unit: Unit, tokens: int) -> None:
        self.finished_n += 1
        self.tokens += tokens
        self.bytes_now += self.sizes[unit.index]
        self.done_bytes += self.sizes[unit.index]
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        left = (self.total_bytes - self.done_bytes) * elapsed / max(self.bytes_now, 1)  # at this session's bytes/s
        self.log(f"data: shard {self.finished_n}/{self.n} ({unit.path.name}) done: {self.done_bytes / self.total_bytes:.0%} "
                 f"of the corpus, {self.tokens / elapsed:,.0f} tokens/s, ETA {format_eta(left)}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def format_eta(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``2h10m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
