"""Hold-out: which data becomes the eval set (``data.eval``: a file, a fraction of the rows, or a fraction of the blocks).

- ``data.eval: FILE``: the file is the eval set; training rows identical to one of its rows are
  dropped (counted), so nothing is evaluated that was trained on.
- ``data.eval: FRACTION``: that share of the training rows, chosen by a seeded content hash, so
  identical rows always land on the same side; when long documents are split into blocks
  (``too_long: split``) the share is taken of the blocks instead (a one-file corpus is one row but
  many blocks).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from .sources import BadRows, DataError, Row, iter_source
from .store import TokenStore, split_store

HoldoutKind = Literal["file", "rows", "blocks", "none"]


def holdout_kind(eval_setting: str | float | None, too_long: str) -> HoldoutKind:
    """How ``data.eval`` holds out eval data, given the format's ``too_long`` policy."""
    if isinstance(eval_setting, str):
        return "file"
    if isinstance(eval_setting, float):
        return "blocks" if too_long == "split" else "rows"
    return "none"


def row_hash(row: Row, seed: int) -> int:
    """Content hash of a row (seeded): identical rows hash alike, wherever they come from."""
    blob = json.dumps(row.data, sort_keys=True, ensure_ascii=False, default=str).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8, key=seed.to_bytes(8, "little", signed=True)).digest(), "little")


def row_threshold(rows: Iterable[Row], fraction: float, seed: int) -> int:
    """The row-hash threshold holding out ``fraction`` of ``rows`` (one pass: 8 bytes a row)."""
    hashes = np.fromiter((row_hash(r, seed) for r in rows), dtype=np.uint64)
    if len(hashes) < 2:
        raise DataError(
            f"data.eval={fraction}: a held-out fraction needs at least 2 rows, found {len(hashes)}; "
            "set data.too_long: split to hold out blocks instead, give data.eval a file, or set data.eval: null"
        )
    k = min(len(hashes) - 1, max(1, round(fraction * len(hashes))))
    return int(np.partition(hashes, k - 1)[k - 1])


class SpilledRows:
    """Held-out rows written to a JSONL file as they stream by, read back once: memory stays flat."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "w", encoding="utf-8")

    def add(self, row: Row, source: int = 0) -> None:
        self._file.write(json.dumps([row.where, row.data, source], ensure_ascii=False, default=str) + "\n")

    def rows(self) -> Iterator[tuple[int, Row]]:
        """(source, row) of each held-out row, in the order they were added."""
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                where, data, source = json.loads(line)
                yield source, Row(data, where)
        self.path.unlink()


class RowHoldout:
    """Sorts training rows as they stream by: held out for eval (set aside in a spill file), a copy of
    an eval-file row (dropped, counted in ``overlap``), or kept for training (``keep``)."""

    def __init__(self, seed: int, threshold: int | None = None, eval_hashes: set[int] | None = None, spill: Path | None = None):
        self.seed, self.threshold, self.eval_hashes = seed, threshold, eval_hashes or set()
        self.spill = SpilledRows(spill) if threshold is not None and spill is not None else None
        self.overlap = 0

    @classmethod
    def of_file(cls, path: str, seed: int, txt_mode: str) -> RowHoldout:
        """Training rows against the eval file ``path``: its copies are dropped. DataError when it has no rows."""
        if next(iter_source(path, BadRows("skip"), txt_mode), None) is None:
            raise DataError(f"data.eval={path!r}: no rows found")
        return cls(seed, eval_hashes={row_hash(r, seed) for r in iter_source(path, BadRows("skip"), txt_mode)})

    @classmethod
    def of_fraction(cls, rows: Iterable[Row], fraction: float, seed: int, spill: Path) -> RowHoldout:
        """``fraction`` of the training rows (``rows``: a first pass over them) held out, spilled to ``spill``."""
        return cls(seed, threshold=row_threshold(rows, fraction, seed), spill=spill)

    def keep(self, row: Row, source: int = 0) -> bool:
        """Whether ``row`` (of training source ``source``) trains; a held-out row is spilled, a copy of an eval row
        counted."""
        if self.spill is None and not self.eval_hashes:
            return True
        h = row_hash(row, self.seed)
        if self.spill is not None and h <= self.threshold:
            self.spill.add(row, source)  # identical rows share a hash: never on both sides
            return False
        if h in self.eval_hashes:
            self.overlap += 1
            return False
        return True

    def held_out(self, n_sources: int = 1) -> Iterator[Iterator[Row]]:
        """The held-out rows, once, after every training row went by: an iterator of each training source's (rows
        are spilled in source order), so the eval store keeps the sources apart for a loss per source."""
        rows = self.spill.rows() if self.spill is not None else iter(())
        pending = next(rows, None)
        for k in range(n_sources):

            def of_source() -> Iterator[Row]:
                nonlocal pending
                while pending is not None and pending[0] == k:
                    yield pending[1]
                    pending = next(rows, None)

            yield of_source()


def held_out_blocks(store: TokenStore, fraction: float, seed: int) -> np.ndarray:
    """Which sequences (blocks) of ``store`` to hold out: the ``fraction`` with the smallest seeded
    content hashes. Identical blocks hash alike, so they always land on the same side."""
    n = len(store)
    if n < 2:
        raise DataError(
            f"data.eval={fraction}: holding out a fraction of the blocks needs at least 2 blocks, found {n}; "
            "lower data.max_length, give data.eval a file, or set data.eval: null"
        )
    key = seed.to_bytes(8, "little", signed=True)
    hashes = np.empty(n, dtype=np.uint64)
    for i, j in store.slices(1 << 24):  # read in slices: bounded memory for any corpus size
        base = int(store.offsets[i])
        ids = store.read(base, int(store.offsets[j]))[0]
        for q in range(i, j):
            block = ids[store.offsets[q] - base : store.offsets[q + 1] - base].tobytes()
            hashes[q] = int.from_bytes(hashlib.blake2b(block, digest_size=8, key=key).digest(), "little")
    k = min(n - 1, max(1, round(fraction * n)))
    return hashes <= np.partition(hashes, k - 1)[k - 1]


def split_off_blocks(whole: Path, fraction: float, seed: int, train: Path, eval_dir: Path, vocab: int) -> tuple[dict[str, int], dict[str, int]]:
    """Split the store at ``whole`` into a train and an eval store (``held_out_blocks``), then remove
    it; returns the two sides' counts (``store.split_store``)."""
    store = TokenStore(whole)
    counts = split_store(store, held_out_blocks(store, fraction, seed), train, eval_dir, vocab)
    del store  # its memory maps close before the files go
    shutil.rmtree(whole)
    return counts
