"""Held-out loss and perplexity."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..data.loader import Batch
from ..hardware import Precision
from .step import loss_sum


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[Batch], precision: Precision, device: torch.device) -> dict:
    """Token-weighted mean loss over all eval batches (one host sync, at the end)."""
    if not batches:
        return {}
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    n = 0
    for batch in batches:
        total += loss_sum(model, batch.to(device), precision).double()
        n += batch.n_targets
    model.train(was_training)
    loss = float(total) / n
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": n}
