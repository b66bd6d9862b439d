"""Held-out loss and perplexity."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..data.loader import Batch
from ..dist import DistContext
from ..hardware import Precision
from .step import loss_sum


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    precision: Precision,
    device: torch.device,
    ctx: DistContext | None = None,
    fused: bool = True,
) -> dict:
    """Token-weighted mean loss over all eval batches (one host sync, at the end).

    Data-parallel: rank r evaluates batches r, r + world, ... and the sums are all-reduced.
    Every rank runs the same number of forward passes (a rank short of one repeats a batch
    and does not count it): FSDP's forward is a collective.
    """
    if not batches:
        return {}
    ctx = ctx or DistContext()
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    n = 0
    rounds = -(-len(batches) // ctx.world_size)
    for i in range(ctx.rank, rounds * ctx.world_size, ctx.world_size):
        summed = loss_sum(model, batches[i % len(batches)].to(device), precision, fused).double()
        if i < len(batches):
            total += summed
            n += batches[i].n_targets
    model.train(was_training)
    if ctx.enabled:
        sums = ctx.all_reduce(torch.stack([total, torch.tensor(float(n), device=device, dtype=torch.float64)]))
        total, n = sums[0], int(sums[1])
    loss = float(total) / n
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": n}
