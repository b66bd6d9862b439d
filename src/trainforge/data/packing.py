"""Training rows from stored sequences: packed (best-fit decreasing), concatenated blocks, or one per row.

A row is an (k, 2) array of [start, end) segments into the store's flat token arrays.
"""

from __future__ import annotations

import numpy as np

from .store import TokenStore


def weighted_indices(store: TokenStore, weights: list[float], seed: int) -> np.ndarray:
    """Sequence indices for one epoch's mix: each source ``weight`` times (fraction sampled, seeded)."""
    rng = np.random.default_rng([seed, 7])
    parts = []
    for k, w in enumerate(weights):
        idx = np.arange(store.source_of(k).start, store.source_of(k).stop)
        whole, frac = int(w), w - int(w)
        parts.extend([idx] * whole)
        if frac > 0 and len(idx):
            parts.append(np.sort(rng.choice(idx, size=round(frac * len(idx)), replace=False)))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pack items (by index) into as few rows of ``capacity`` as best-fit decreasing finds.

    Longest first; each goes into the open row with the least room that still fits it.
    Rows are found through a table of rows by remaining room, so each placement is one
    vectorized scan of at most ``capacity`` flags instead of a search over all rows.
    """
    rows: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # row ids by remaining room
    has_room = np.zeros(capacity + 1, dtype=bool)
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"item {i} of length {n} exceeds the row capacity {capacity}")
        k = n + int(has_room[n:].argmax())  # the smallest room >= n that some row has (if any)
        if has_room[k]:
            r = by_room[k].pop()
            if not by_room[k]:
                has_room[k] = False
            rows[r].append(int(i))
            room = k - n
        else:
            r = len(rows)
            rows.append([int(i)])
            room = capacity - n
        if room > 0:
            by_room[room].append(r)
            has_room[room] = True
    return rows


def packed_rows(store: TokenStore, index: np.ndarray, max_length: int) -> list[np.ndarray]:
    """Sequences packed into rows of ``max_length`` inputs; each keeps its own positions and mask."""
    starts, ends = store.offsets[index], store.offsets[index + 1]
    inputs = ends - starts - 1  # a stored sequence of n tokens gives n - 1 inputs
    return [np.stack([starts[r], ends[r]], axis=1) for r in best_fit_decreasing(inputs, max_length)]


def pair_rows(store: TokenStore, pairs: np.ndarray, max_length: int) -> list[np.ndarray]:
    """Preference pairs packed into rows of ``max_length`` inputs: pair k is stored as sequences 2k (chosen) and
    2k + 1 (rejected), and both go into the same row, chosen first, as two documents (one forward computes
    both sides). Pairs are packed whole, best-fit decreasing by their two sides' inputs."""
    chosen, rejected = 2 * pairs, 2 * pairs + 1
    starts_c, ends_c = store.offsets[chosen], store.offsets[chosen + 1]
    starts_r, ends_r = store.offsets[rejected], store.offsets[rejected + 1]
    inputs = (ends_c - starts_c - 1) + (ends_r - starts_r - 1)
    rows = []
    for r in best_fit_decreasing(inputs, max_length):
        segments = np.stack([starts_c[r], ends_c[r], starts_r[r], ends_r[r]], axis=1).reshape(-1, 2)
        rows.append(segments)  # chosen, rejected, chosen, rejected, ...
    return rows


def single_rows(store: TokenStore, index: np.ndarray) -> list[np.ndarray]:
    """One sequence per row (no packing)."""
    return [np.array([[store.offsets[i], store.offsets[i + 1]]]) for i in index]


def concat_rows(store: TokenStore, index: np.ndarray, max_length: int) -> list[np.ndarray]:
    """The classic pretraining stream: sequences joined and cut into blocks of ``max_length`` inputs.

    Consecutive blocks overlap by one token, so every token after the first is a target once.
    A split continuation that follows its predecessor in ``index`` drops its first token (a repeat
    of the predecessor's last, kept in the store for rows of their own): the stream holds each
    token of the corpus once.
    """
    starts, ends = store.offsets[index], store.offsets[index + 1]
    if len(index) > 1:
        follows = np.zeros(len(index), dtype=bool)
        follows[1:] = index[1:] == index[:-1] + 1
        starts = starts + (follows & store.continues[index])
    cum = np.concatenate([[0], np.cumsum(ends - starts)])
    total = int(cum[-1])
    rows = []
    for b in range(0, max(total - 1, 0), max_length):
        e = min(b + max_length + 1, total)
        first, last = np.searchsorted(cum, b, "right") - 1, np.searchsorted(cum, e, "left")
        j = np.arange(first, last)
        seg_start = starts[j] + np.maximum(b - cum[j], 0)
        seg_end = starts[j] + np.minimum(e - cum[j], ends[j] - starts[j])
        rows.append(np.stack([seg_start, seg_end], axis=1))
    return rows


def build_rows(store: TokenStore, index: np.ndarray, packing: bool | str, max_length: int) -> list[np.ndarray]:
    if packing == "concat":
        return concat_rows(store, index, max_length)
    if packing:
        return packed_rows(store, index, max_length)
    return single_rows(store, index)


def row_tokens(row: np.ndarray, concat: bool) -> int:
    """Input tokens of a row."""
    n = int((row[:, 1] - row[:, 0]).sum())
    return n - 1 if concat else n - len(row)
