"""Held-out loss and perplexity."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..data.loader import Batch
from ..dist import DistContext
from ..hardware.device import Precision
from ..metrics.by_source import SOURCE_SUMS, source_losses
from .objective import mean_metrics
from .step import loss_sum


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    precision: Precision,
    device: torch.device,
    ctx: DistContext | None = None,
    fused: bool = True,
    objective: Any = None,
    stop: Callable[[], None] | None = None,
    source_names: Sequence[str] = (),
) -> dict:
    """Token-weighted mean loss over all eval batches (one host sync, at the end); with a pair ``objective``
    (engine/objective.py) the mean loss per pair, and its metrics as ``eval_<name>`` (no perplexity).

    ``stop``: called before each batch; it raises to end the evaluation on a signal.
    ``source_names``: a mixture's sources, each evaluated apart as ``eval_loss/NAME`` where the eval set keeps them.
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
    n, metrics, scratch = 0, {}, {}  # scratch: the metrics of repeated batches, not counted
    # a mixture's sums per source; zeros first, so every rank all-reduces the same keys
    by_source = {SOURCE_SUMS: torch.zeros(2, batches[0].n_sources, device=device)} if batches[0].source_ids is not None else {}
    pairs = objective is not None and objective.unit == "pair"
    rounds = -(-len(batches) // ctx.world_size)
    mine = range(ctx.rank, rounds * ctx.world_size, ctx.world_size)
    if pairs:  # KTO: the reference point over the whole evaluation (every batch, every process), as a step's
        objective.begin_step(model, [batches[i % len(batches)] for i in mine], precision, device, fused,
                             counted=[i < len(batches) for i in mine])
    for i in mine:
        if stop is not None:
            stop()  # raises for a SIGTERM/SIGINT (engine/ending.py eval_stop): an evaluation is no step to finish
        batch, counted = batches[i % len(batches)].to(device), i < len(batches)
        if pairs:
            summed = objective.loss_sum(model, batch, precision, fused, metrics if counted else scratch).double()
        else:
            summed = loss_sum(model, batch, precision, fused, by_source=by_source if counted else scratch).double()
        if counted:
            total += summed
            n += objective.units(batches[i]) if pairs else batches[i].n_targets
    model.train(was_training)
    if ctx.enabled:
        sums = ctx.all_reduce(torch.stack([total, torch.tensor(float(n), device=device, dtype=torch.float64)]))
        total, n = sums[0], int(sums[1])
    loss = float(total) / n
    if pairs:
        metrics = metrics or {k: torch.zeros_like(v) for k, v in scratch.items()}  # the same keys in every rank's all-reduce
        return {"eval_loss": loss, **mean_metrics(metrics, "eval_", ctx.all_reduce), "eval_pairs": n}
    per_source = source_losses(by_source, source_names, "eval_loss/", ctx.all_reduce if ctx.enabled else None)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": n, **per_source}


def planned_evals(max_steps: int, eval_every: int | None) -> int:
    """Evaluations a run of ``max_steps`` makes: before and after training, and every ``eval_every`` steps between."""
    return 2 + ((max_steps - 1) // eval_every if eval_every else 0)


def auto_eval_batches(
    available: int,
    eval_rows_per_batch: int,
    train_rows: int,
    evals: int,
    method: str = "full",
    activation_checkpointing: bool = False,
    world_size: int = 1,
) -> int:
    """Eval batches per evaluation for ``train.eval_max_batches: auto``: the most (of ``available``, at least
    one) that keep ``evals`` evaluations within the ``eval_share`` threshold of the training compute.

    ``train_rows``: rows the whole run trains on (all steps, all processes); ``world_size``: processes. Eval rows are held out of the
    same data, so a row of either side holds as many tokens on average and rows stand for tokens.
    Counted in FLOPs, not seconds, so it is the same on every machine and every rerun: an eval token costs
    one forward; a trained token costs a forward and a backward, about three forwards for a full fine-tune
    and two with adapters (the frozen base computes no weight gradients), one more with activation
    checkpointing (the forward runs again)."""
    from ..metrics.thresholds import limit

    forwards = (3.0 if method == "full" else 2.0) + (1.0 if activation_checkpointing else 0.0)
    budget = limit("eval_share") * train_rows * forwards / max(evals, 1)
    # whole rounds of one batch per process: the same rows whatever the process count and micro-batch
    # that make up the global batch (rows are evaluated in stored order)
    rounds = max(1, int(budget // max(eval_rows_per_batch * world_size, 1)))
    return min(available, rounds * world_size)
