"""The token store: tokenized sequences on disk, memory-mapped back.

Layout of a store directory:
  ids.bin      all sequences back to back (uint16 when the vocabulary fits, else uint32)
  learn.bin    uint8, 1 where the token is a target
  offsets.npy  int64, sequence i is [offsets[i], offsets[i+1])
  sources.npy  int64, sequences of source k are [sources[k], sources[k+1])
  continues.npy  bool, sequence i is a split continuation of i - 1 (its first token repeats i - 1's last)
  desirable.npy  bool, an unpaired (KTO) store only: the label of sequence i's example
  meta.json    dtype, counts, statistics
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class StoreWriter:
    """Appends tokenized chunks to a store directory; memory use is one chunk."""

    def __init__(self, path: Path, vocab_size: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self._ids = open(path / "ids.bin", "wb")
        self._learn = open(path / "learn.bin", "wb")
        self._lengths: list[np.ndarray] = []
        self._continues: list[np.ndarray] = []
        self._desirable: list[np.ndarray] = []
        self.source_starts: list[int] = []
        self.n_sequences = 0

    def start_source(self) -> None:
        self.source_starts.append(self.n_sequences)

    def append(
        self, ids: np.ndarray, learn: np.ndarray, lengths: np.ndarray, continues: np.ndarray | None = None,
        desirable: np.ndarray | None = None,
    ) -> None:
        self._ids.write(ids.astype(self.dtype, copy=False).tobytes())
        self._learn.write(learn.astype(np.uint8, copy=False).tobytes())
        # copies: a view would keep the caller's whole array alive for the life of the writer
        self._lengths.append(np.array(lengths, dtype=np.int64))
        self._continues.append(np.zeros(len(lengths), bool) if continues is None else np.array(continues, dtype=bool))
        if desirable is not None:
            self._desirable.append(np.array(desirable, dtype=bool))
        self.n_sequences += len(lengths)

    def close(self, meta: dict[str, Any]) -> None:
        self._ids.close()
        self._learn.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(self.path / "offsets.npy", offsets)
        np.save(self.path / "sources.npy", np.asarray([*self.source_starts, self.n_sequences], dtype=np.int64))
        continues = np.concatenate(self._continues) if self._continues else np.zeros(0, bool)
        np.save(self.path / "continues.npy", continues)
        if self._desirable:
            np.save(self.path / "desirable.npy", np.concatenate(self._desirable))
        (self.path / "meta.json").write_text(json.dumps({"dtype": self.dtype.name, "sequences": int(len(lengths)), **meta}, indent=2))


class TokenStore:
    """Read side: memory-mapped token and mask arrays plus the sequence index."""

    def __init__(self, path: Path):
        self.path = path
        self.meta = json.loads((path / "meta.json").read_text())
        self.offsets = np.load(path / "offsets.npy")
        self.source_starts = np.load(path / "sources.npy")
        cont = path / "continues.npy"
        self.continues = np.load(cont) if cont.is_file() else np.zeros(len(self.offsets) - 1, bool)
        labels = path / "desirable.npy"
        self.desirable = np.load(labels) if labels.is_file() else None  # KTO: each sequence's example label
        n = int(self.offsets[-1])
        # np.memmap cannot map an empty file; an empty store is legal (e.g. no eval rows)
        self.ids = np.memmap(path / "ids.bin", dtype=self.meta["dtype"], mode="r") if n else np.zeros(0, self.meta["dtype"])
        self.learn = np.memmap(path / "learn.bin", dtype=np.uint8, mode="r") if n else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return np.asarray(self.ids[a:b], dtype=np.int64), np.asarray(self.learn[a:b], dtype=bool)

    def read(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and learn flags ``[a, b)`` read from the files, not the maps: a pass over a large
        store this way leaves no mapped pages behind in the process's memory."""
        if b <= a:
            return np.zeros(0, self.ids.dtype), np.zeros(0, np.uint8)
        ids = np.fromfile(self.path / "ids.bin", dtype=self.ids.dtype, count=b - a, offset=a * self.ids.dtype.itemsize)
        learn = np.fromfile(self.path / "learn.bin", dtype=np.uint8, count=b - a, offset=a)
        return ids, learn

    def slices(self, max_tokens: int) -> Iterator[tuple[int, int]]:
        """Consecutive sequence ranges ``[i, j)`` of at most ``max_tokens`` tokens (one sequence when longer)."""
        i, n = 0, len(self)
        while i < n:
            j = max(i + 1, int(np.searchsorted(self.offsets, self.offsets[i] + max_tokens, "right")) - 1)
            yield i, min(j, n)
            i = min(j, n)

    def source_of(self, k: int) -> range:
        """Sequence indices of the k-th source."""
        return range(int(self.source_starts[k]), int(self.source_starts[k + 1]))

    @property
    def n_sources(self) -> int:
        return len(self.source_starts) - 1


# tokens copied per slice when splitting a store: bounds memory for stores of any size
_COPY_TOKENS = 1 << 24


def split_store(src: TokenStore, to_eval: np.ndarray, train_path: Path, eval_path: Path, vocab_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """Write ``src``'s sequences into a train store and an eval store (``to_eval``), in order, sources kept on both.

    A split continuation stays one only when the sequence before it went to the same side.
    Returns each side's counts: sequences, input tokens (and their per-sequence squares) and target tokens.
    """
    side = np.asarray(to_eval, dtype=np.int64)
    continues = src.continues.copy()
    continues[1:] &= side[1:] == side[:-1]
    writers = (StoreWriter(train_path, vocab_size), StoreWriter(eval_path, vocab_size))
    counts = tuple({"sequences": 0, "tokens": 0, "token_squares": 0, "target_tokens": 0} for _ in range(2))
    source = np.searchsorted(src.source_starts, np.arange(len(src)), "right") - 1  # source of each sequence
    lengths = src.lengths
    k = -1
    for i0, j0 in src.slices(_COPY_TOKENS):
        base = int(src.offsets[i0])
        ids, learn = src.read(base, int(src.offsets[j0]))
        # runs of consecutive sequences bound for the same side and source
        key = side[i0:j0] * (src.n_sources + 1) + source[i0:j0]
        bounds = [i0, *(i0 + 1 + np.flatnonzero(key[1:] != key[:-1])).tolist(), j0]
        for i, j in zip(bounds[:-1], bounds[1:]):
            while k < source[i]:  # sources with no sequences still get their (empty) range, on both sides
                writers[0].start_source()
                writers[1].start_source()
                k += 1
            a, b = int(src.offsets[i]) - base, int(src.offsets[j]) - base
            s = int(side[i])
            writers[s].append(ids[a:b], learn[a:b], lengths[i:j], continues[i:j])
            c = counts[s]
            c["sequences"] += j - i
            c["tokens"] += (b - a) - (j - i)  # inputs: all but each sequence's last token
            c["token_squares"] += int(((lengths[i:j].astype(np.int64) - 1) ** 2).sum())
            c["target_tokens"] += int(learn[a:b].sum()) - int(learn[src.offsets[i:j] - base].sum())
    while k < src.n_sources - 1:
        writers[0].start_source()
        writers[1].start_source()
        k += 1
    writers[0].close({"held_out": "blocks"})
    writers[1].close({"held_out": "blocks"})
    return counts
