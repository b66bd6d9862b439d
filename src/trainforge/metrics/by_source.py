"""A mixture's loss per source: sums kept on the device beside the loss, read at log steps and evaluations.

A batch of a mixture carries each position's source (``Batch.source_ids``); the loss adds each target's loss and a
count of 1 to its source's column of a ``(2, K)`` tensor under ``SOURCE_SUMS`` in the step's metric sums (the log
window adds them up like an objective's metrics). Reading them is one transfer at the log step, no new sync point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

SOURCE_SUMS = "by_source"  # (2, K): loss sums, then target counts, per source


def source_sums(by_source: dict[str, torch.Tensor] | None, batch) -> torch.Tensor | None:
    """The ``(2, K)`` sums a batch of a mixture adds to (made on its device at the first), or None: no mixture,
    or no place to add them."""
    if by_source is None or batch.source_ids is None:
        return None
    sums = by_source.get(SOURCE_SUMS)
    if sums is None:
        sums = by_source[SOURCE_SUMS] = torch.zeros(2, batch.n_sources, device=batch.labels.device)
    return sums


def add_by_source(sums: torch.Tensor, groups: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor) -> None:
    """Add per-position ``losses`` (0 where no target) and the ``targets`` mask to their sources' columns; masks
    by multiplying, not indexing: a boolean index would wait for the device."""
    sums[0].index_add_(0, groups, losses.float())
    sums[1].index_add_(0, groups, targets.float())


def source_losses(sums: dict[str, torch.Tensor], names: Sequence[str] | Callable[[], Sequence[str]], prefix: str = "loss/",
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """``{prefix + name: mean loss}`` of each source with targets (one host read), empty without a mixture's sums;
    ``names``: the sources' names, or a function giving them (asked only for a mixture). ``reduce`` sums the sums
    over processes (every rank holds the key: every rank's batches come from the same mixture)."""
    t = sums.get(SOURCE_SUMS)
    if t is None:
        return {}
    names = names() if callable(names) else names
    t = reduce(t) if reduce is not None else t
    loss, count = t.tolist()
    return {f"{prefix}{name}": s / n for name, s, n in zip(names, loss, count) if n > 0}


def describe_losses(rec: dict[str, float], prefix: str = "loss/") -> str:
    """`` | chat 2.3104 code 3.0012`` from a record's per-source losses; empty without them."""
    parts = [f"{k[len(prefix):]} {v:.4f}" for k, v in rec.items() if k.startswith(prefix)]
    return f" | {' '.join(parts)}" if parts else ""
