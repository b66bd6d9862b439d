"""Batches of examples: seeded order per epoch, right-padded to a multiple of 8."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .formats import IGNORE, Example

PAD_MULTIPLE = 8  # tensor-core friendly shapes, and fewer distinct shapes for kernels to tune for


@dataclass
class Batch:
    """Tensors of one micro-batch plus counts known without touching the device."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None  # None when no row is padded: lets attention take its causal fast path
    n_tokens: int  # real (non-pad) input tokens
    n_targets: int  # tokens that carry loss
    indices: list[int]

    def to(self, device: torch.device) -> "Batch":
        nb = device.type == "cuda"  # async copy from pinned memory
        mask = self.attention_mask.to(device, non_blocking=nb) if self.attention_mask is not None else None
        return Batch(
            self.input_ids.to(device, non_blocking=nb),
            self.labels.to(device, non_blocking=nb),
            mask,
            self.n_tokens,
            self.n_targets,
            self.indices,
        )


def collate(examples: Sequence[Example], pad_id: int, indices: list[int] | None = None, pin: bool = False) -> Batch:
    """Right-pad to the longest row (rounded up to a multiple of 8); pads carry no loss."""
    lengths = [len(e.input_ids) for e in examples]
    longest = max(lengths)
    width = longest if all(n == longest for n in lengths) else -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE, dtype=np.int64)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = e.input_ids
        labels[i, : len(e.labels)] = e.labels
    mask = None
    if any(n != width for n in lengths):
        mask_np = np.zeros((len(examples), width), dtype=np.int64)
        for i, n in enumerate(lengths):
            mask_np[i, :n] = 1
        mask = torch.from_numpy(mask_np)
    batch = Batch(
        torch.from_numpy(ids),
        torch.from_numpy(labels),
        mask,
        n_tokens=int(sum(lengths)),
        n_targets=int((labels != IGNORE).sum()),
        indices=list(indices) if indices is not None else [],
    )
    if pin:  # page-locked host memory makes the host-to-GPU copy asynchronous
        batch.input_ids, batch.labels = batch.input_ids.pin_memory(), batch.labels.pin_memory()
        if batch.attention_mask is not None:
            batch.attention_mask = batch.attention_mask.pin_memory()
    return batch


class TrainLoader:
    """Endless micro-batches over the training examples, reshuffled (seeded) every epoch.

    The position is explicit (epoch, examples consumed in that epoch) so a run can save and
    restore it exactly, and ``batch_size`` may change between batches (halving it and
    doubling accumulation consumes the same examples in the same order).
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, pad_id: int, seed: int, pin: bool = False):
        self.examples, self.batch_size, self.pad_id, self.seed, self.pin = examples, batch_size, pad_id, seed, pin
        self.epoch = 0
        self.offset = 0

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    def __iter__(self) -> Iterator[Batch]:
        order = self.epoch_order(self.epoch)
        while True:
            if self.offset >= len(self.examples):
                self.epoch, self.offset = self.epoch + 1, 0
                order = self.epoch_order(self.epoch)
            idx = order[self.offset : self.offset + self.batch_size].tolist()
            self.offset += len(idx)
            yield collate([self.examples[i] for i in idx], self.pad_id, idx, self.pin)


def eval_batches(examples: Sequence[Example], batch_size: int, pad_id: int, max_batches: int | None = None) -> list[Batch]:
    """Eval examples in file order; the same batches every time they are evaluated."""
    n = -(-len(examples) // batch_size)
    if max_batches is not None:
        n = min(n, max_batches)
    return [
        collate(examples[i * batch_size : (i + 1) * batch_size], pad_id, list(range(i * batch_size, (i + 1) * batch_size)))
        for i in range(n)
    ]
