"""Batches of rows: seeded order per epoch, fixed shapes when packed, length-grouped when not."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .formats import IGNORE
from .packing import row_tokens
from .store import TokenStore

PAD_MULTIPLE = 8  # tensor-core friendly shapes, and fewer distinct shapes for kernels to tune for
def padded_width(n: int) -> int:
    """The width of a padded row holding ``n`` tokens: ``n`` rounded up to a multiple of PAD_MULTIPLE."""
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


LENGTH_GROUP_ROWS = 256  # unpacked rows are sorted by length within groups of this many (shuffled) rows


@dataclass
class Batch:
    """Tensors of one micro-batch plus counts known without touching the device."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    # restart at 0 for each packed document: the model masks attention across documents from them.
    # None when rows hold one document each (right padding needs no mask under causal attention).
    position_ids: torch.Tensor | None
    n_tokens: int  # real (non-pad) input tokens (encoder-decoder: the encoder's and the decoder's)
    n_targets: int  # tokens that carry loss
    indices: list[int]  # row indices, to name the examples of a batch
    # encoder-decoder models (data/seq2seq.py): input_ids is the source, labels the target
    attention_mask: torch.Tensor | None = None  # the source's real tokens (padding is not attended to)
    decoder_input_ids: torch.Tensor | None = None  # the target shifted right behind the decoder's start token
    n_documents: int = 0  # packed documents (preference rows: a pair's chosen and rejected are two)
    desirable: torch.Tensor | None = None  # KTO: each example's label, in the order of its pairs (example, KL sample)
    reference: torch.Tensor | None = None  # (P, 2) precomputed reference log-probabilities of each pair's two sides
    real: torch.Tensor | None = None  # (B, S) bool: real input tokens, not a row's padding fill (the router loss counts them)
    # a mixture's source of each position (beside labels), for the loss per source (data/mixture.py); None: one source
    source_ids: torch.Tensor | None = None
    n_sources: int = 0

    def _map(self, fn) -> "Batch":
        t = lambda x: fn(x) if x is not None else None  # noqa: E731
        return Batch(
            fn(self.input_ids), fn(self.labels), t(self.position_ids), self.n_tokens, self.n_targets, self.indices,
            t(self.attention_mask), t(self.decoder_input_ids), self.n_documents, t(self.desirable), t(self.reference),
            t(self.real), t(self.source_ids), self.n_sources,
        )

    def to(self, device: torch.device) -> "Batch":
        nb = device.type == "cuda"  # async copy from pinned memory
        return self._map(lambda x: x.to(device, non_blocking=nb))

    def pinned(self) -> "Batch":
        """In page-locked host memory: the host-to-GPU copy becomes asynchronous."""
        return self._map(lambda x: x.pin_memory())


class RowCollator:
    """Turns rows (segments of the token store) into padded tensors."""

    def __init__(self, store: TokenStore, pad_id: int, mode: bool | str, max_length: int, pin: bool = False):
        self.store, self.pad_id, self.max_length, self.pin = store, pad_id, max_length, pin
        self.concat, self.packed = mode == "concat", mode is True
        # preference.reference: precompute: the reference's log-probability of every stored sequence (float32)
        self.reference: np.ndarray | None = None
        # where each source's tokens begin in the flat arrays: a segment's source, for the loss per source
        self.source_tokens = store.offsets[store.source_starts[:-1]] if store.n_sources > 1 else None

    def _row(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        ids, learn = self.store.ids, self.store.learn
        if self.concat:  # one stream across documents: inputs all but last, targets all but first
            toks = np.concatenate([ids[s:e] for s, e in row]).astype(np.int64)
            keep = np.concatenate([learn[s:e] for s, e in row]).astype(bool)
            return toks[:-1], np.where(keep[1:], toks[1:], IGNORE), None
        inputs, labels, positions = [], [], []
        for s, e in row:  # each document on its own: its own next-token targets and positions
            toks = np.asarray(ids[s:e], dtype=np.int64)
            inputs.append(toks[:-1])
            labels.append(np.where(learn[s + 1 : e].astype(bool), toks[1:], IGNORE))
            positions.append(np.arange(e - s - 1))
        return np.concatenate(inputs), np.concatenate(labels), np.concatenate(positions)

    def _sources(self, row: np.ndarray) -> np.ndarray:
        """The source of each input position of a row, aligned with ``_row``'s labels."""
        of = np.searchsorted(self.source_tokens, row[:, 0], "right") - 1
        lengths = row[:, 1] - row[:, 0]
        if self.concat:  # one stream: targets are all its tokens but the first
            return np.repeat(of, lengths)[1:]  # the source of each target token
        return np.repeat(of, lengths - 1)

    def pair_sequences(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        """The stored index of each pair's first sequence in pair rows, in row-major order."""
        starts = np.concatenate([r[0::2, 0] for r in rows]) if rows else np.zeros(0, np.int64)
        return np.searchsorted(self.store.offsets, starts, "right") - 1

    def _pair_fields(self, rows: Sequence[np.ndarray]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(KTO labels (P,), precomputed reference log-probabilities (P, 2)) of pair rows, each where the store
        has labels / the collator has a reference table, in the order of the rows' pairs."""
        if self.store.desirable is None and self.reference is None:
            return None, None
        first = self.pair_sequences(rows)
        labels = torch.from_numpy(self.store.desirable[first].copy()) if self.store.desirable is not None else None
        ref = None if self.reference is None else torch.from_numpy(np.stack([self.reference[first], self.reference[first + 1]], axis=1))
        return labels, ref

    def __call__(self, rows: Sequence[np.ndarray], indices: list[int]) -> Batch:
        built = [self._row(r) for r in rows]
        sources = [self._sources(r) for r in rows] if self.source_tokens is not None else None
        longest = max(len(b[0]) for b in built)
        width = self.max_length if (self.packed or self.concat) else padded_width(longest)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64) if self.packed else None
        for i, (inp, lab, pos) in enumerate(built):
            n = len(inp)
            ids[i, :n], labels[i, :n] = inp, lab
            if positions is not None:
                positions[i, :n] = pos
                positions[i, n:] = np.arange(width - n)  # the padding tail is a document of its own
        batch = Batch(
            torch.from_numpy(ids),
            torch.from_numpy(labels),
            torch.from_numpy(positions) if positions is not None else None,
            n_tokens=int(sum(len(b[0]) for b in built)),
            n_targets=int((labels != IGNORE).sum()),
            indices=list(indices),
            n_documents=sum(len(r) for r in rows) if self.packed else len(rows),
        )
        batch.desirable, batch.reference = self._pair_fields(rows)
        lengths = torch.tensor([len(b[0]) for b in built])
        batch.real = torch.arange(width)[None, :] < lengths[:, None]
        if sources is not None:
            ids_of = np.zeros((len(rows), width), dtype=np.int64)  # padding: no target, so any source
            for i, src in enumerate(sources):
                ids_of[i, : len(src)] = src
            batch.source_ids, batch.n_sources = torch.from_numpy(ids_of), len(self.source_tokens)
        return batch.pinned() if self.pin else batch  # page-locked: the host-to-GPU copy is asynchronous


class TrainLoader:
    """Endless micro-batches over training rows, reshuffled (seeded) every epoch.

    The position is explicit (epoch, rows consumed in that epoch) so a run can save and
    restore it exactly, and ``batch_size`` may change between batches (halving it and
    doubling accumulation consumes the same rows in the same order). Unpacked rows are
    sorted by length within groups of a fixed number of rows, so the order does not
    depend on the batch size either.

    With ``world_size`` ranks, every rank walks the same seeded order and each yield takes one
    global micro-batch of ``batch_size x world_size`` rows, of which rank ``rank`` keeps its
    contiguous share: nothing is dropped or duplicated, and the position (in global rows) is
    the same on every rank. A rank whose share of a short epoch tail is empty gets a row with
    no targets, so it still joins the step's collectives but adds nothing to the loss.
    """

    def __init__(
        self,
        rows: Sequence[np.ndarray],
        collate: RowCollator,
        batch_size: int,
        seed: int,
        group_by_length: bool,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.rows, self.collate, self.batch_size, self.seed = rows, collate, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.group_by_length = group_by_length
        self.lengths = np.asarray([row_tokens(r, collate.concat) for r in rows]) if group_by_length else None
        self.epoch = 0
        self.offset = 0
        self.longest_first = False  # plan --measure: every epoch in descending row length (the worst case first)

    @property
    def batches_per_epoch(self) -> int:
        """Global micro-batches per epoch (each of ``batch_size x world_size`` rows)."""
        return -(-len(self.rows) // (self.batch_size * self.world_size))

    def epoch_order(self, epoch: int) -> np.ndarray:
        if self.longest_first:
            lengths = np.asarray([row_tokens(r, self.collate.concat) for r in self.rows])
            return np.argsort(-lengths, kind="stable")
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        if self.lengths is not None:  # longest first within each group: similar lengths share a batch
            groups = [order[i : i + LENGTH_GROUP_ROWS] for i in range(0, len(order), LENGTH_GROUP_ROWS)]
            order = np.concatenate([g[np.argsort(-self.lengths[g], kind="stable")] for g in groups])
        return order

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    def __iter__(self) -> Iterator[Batch]:
        order = self.epoch_order(self.epoch)
        while True:
            if self.offset >= len(self.rows):
                self.epoch, self.offset = self.epoch + 1, 0
                order = self.epoch_order(self.epoch)
            glob = order[self.offset : self.offset + self.batch_size * self.world_size].tolist()
            self.offset += len(glob)
            n, r, w = len(glob), self.rank, self.world_size
            idx = glob[r * n // w : (r + 1) * n // w]  # contiguous shares: rank order rebuilds the global batch
            if idx:
                yield self.collate([self.rows[i] for i in idx], idx)
            else:
                yield self.empty_share(glob[0])

    def empty_share(self, row: int) -> Batch:
        """A batch of one row without targets: the same computation as a real one, no effect on the loss."""
        b = self.collate([self.rows[row]], [])
        b.labels.fill_(IGNORE)
        b.n_tokens, b.n_targets, b.n_documents = 0, 0, 0
        if b.real is not None:
            b.real.fill_(False)
        if b.desirable is not None:
            b.desirable = b.desirable[:0]  # no pairs: the documents' targets are gone
        if b.reference is not None:
            b.reference = b.reference[:0]
        return b

    def padding_efficiency(self) -> float:
        """Real input tokens / tensor positions over one epoch in this batching (1.0: no padding)."""
        order = self.epoch_order(0)
        real = padded = 0
        for b in range(0, len(order), self.batch_size):
            rows = [self.rows[i] for i in order[b : b + self.batch_size]]
            if hasattr(self.collate, "padding"):  # encoder-decoder: source and target padded apart
                r, p = self.collate.padding(rows)
                real, padded = real + r, padded + p
                continue
            lens = [row_tokens(row, self.collate.concat) for row in rows]
            width = self.collate.max_length if (self.collate.packed or self.collate.concat) else padded_width(max(lens))
            real += sum(lens)
            padded += width * len(lens)
        return real / max(padded, 1)


def eval_batches(rows: Sequence[np.ndarray], collate: RowCollator, batch_size: int, max_batches: int | None = None) -> list[Batch]:
    """Eval rows in stored order; the same batches every time they are evaluated."""
    n = -(-len(rows) // batch_size)
    if max_batches is not None:
        n = min(n, max_batches)
    return [
        collate(rows[i * batch_size : (i + 1) * batch_size], list(range(i * batch_size, min((i + 1) * batch_size, len(rows)))))
        for i in range(n)
    ]
