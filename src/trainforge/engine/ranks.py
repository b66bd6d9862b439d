"""How a run's rows are laid out over its processes: micro-batch x accumulation x processes (``batch_layout``),
and the data-parallel wrapping that spreads them (``wrap_for_ranks``)."""

from __future__ import annotations

import torch

from ..config.run import RunConfig, resolve_grad_accum
from ..data.loader import TrainLoader
from ..dist import DistContext, choose_mode
from ..hardware.device import available_memory_bytes
from ..metrics.console import ConsoleReporter
from .predict.memory import MemoryEstimate
from .resume import ResumePlan, bound_grad_accum, resumed_grad_accum
from .state import rank_seed


def batch_layout(cfg: RunConfig, world_size: int, resume_plan: ResumePlan | None) -> tuple[RunConfig, int, int]:
    """(cfg with the grad_accum its checkpoints bind, micro-batch, accumulation) of this run. ``train.global_batch_size``
    fixes the rows per step whatever the process count: grad_accum follows. A resumed run's come from its checkpoint's
    state (after any out-of-memory back-off): on other processes its micro-batch may divide the global batch where the
    configured one does not."""
    if resume_plan is None or cfg.train.global_batch_size is None:
        accum = resolve_grad_accum(cfg.train, world_size)
        micro, run_accum = cfg.train.micro_batch_size, accum
    else:
        accum = bound_grad_accum(cfg.train, world_size)
        micro, run_accum = resume_plan.state["micro_batch_size"], resumed_grad_accum(resume_plan.state, world_size)
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_accum": accum})}), micro, run_accum


def wrap_for_ranks(
    ctx: DistContext, cfg: RunConfig, model: torch.nn.Module, loader: TrainLoader, accum: int, est: MemoryEstimate,
    device: torch.device, reporter: ConsoleReporter,
) -> torch.nn.Module:
    """Choose DDP or FSDP2 (``train.distributed``) from the model state's size in ``est``, and wrap; alone, the model itself."""
    if not ctx.enabled:
        return model
    known = [a for a in ctx.all_gather_object(available_memory_bytes(device)) if a is not None]
    ctx.mode, why = choose_mode(  # the same inputs on every rank: all ranks choose alike
        cfg.train.distributed, est.weights + est.grads + est.optimizer, min(known) if known else None, ctx.local_world_size
    )
    g = loader.batch_size * accum * ctx.world_size
    reporter.info(
        f"data parallel: {ctx.mode} over {ctx.world_size} processes ({why}); global batch {g} rows = "
        f"micro-batch {loader.batch_size} x accumulation {accum} x {ctx.world_size} processes"
    )
    wrapped = ctx.wrap(model, device)
    if ctx.rank:
        torch.manual_seed(rank_seed(cfg.train.seed, ctx.rank))  # own dropout masks per rank; rank 0 keeps its stream
    return wrapped
