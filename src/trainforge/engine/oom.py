"""Out of memory inside a step: split the micro-batch, multiply accumulation, redo the same examples."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..data.loader import Batch
from ..errors import EXIT_OUT_OF_MEMORY, TrainforgeError
from .step import forward_backward

if TYPE_CHECKING:
    from .run import Run


class OutOfMemory(TrainforgeError, RuntimeError):
    """Out of memory with a micro-batch of one row: nothing left to split."""

    exit_code = EXIT_OUT_OF_MEMORY


def smallest_factor(n: int) -> int:
    """Smallest prime factor of ``n`` (2 for even n): the micro-batch is divided by it."""
    return next((p for p in range(2, int(n**0.5) + 1) if n % p == 0), n)


def fetch_step(run: Run) -> list[Batch]:
    """The micro-batches of one optimizer step."""
    return [next(run.batches) for _ in range(run.grad_accum)]


def forward_backward_adaptive(
    run: Run, micro_batches: list[Batch], position: dict, n_targets: int | None = None
) -> tuple[torch.Tensor, list[Batch], dict[str, torch.Tensor]]:
    """``forward_backward``; on out-of-memory, back off and redo the step's examples from ``position``.

    ``position`` is the loader's state before this step's batches were drawn; it counts
    examples, so the smaller micro-batches re-read the same examples in the same order and
    the step's gradient is the same sum over the same target tokens.
    Data-parallel runs do not back off (the other ranks would be left waiting in a collective):
    they stop with ``OutOfMemory``.
    ``n_targets``: the divisor of the run's objective (target tokens, or pairs) over all ranks.
    Returns (mean loss, the micro-batches finally used, the objective's metric sums).
    """
    while True:
        metrics: dict[str, torch.Tensor] = {}  # a failed attempt's metric sums are dropped with it
        try:
            loss = forward_backward(
                run.train_model, micro_batches, run.precision, run.device, run.scaler, n_targets, run.sync, run.timer,
                run.cfg.train.fused_loss, run.objective, metrics,
            )
            return loss, micro_batches, metrics
        except torch.OutOfMemoryError:
            if run.dist.enabled:
                raise OutOfMemory(
                    f"rank {run.dist.rank}: out of memory at step {run.step + 1} with micro-batch {run.loader.batch_size}; "
                    "data-parallel runs do not back off: lower train.micro_batch_size and raise train.grad_accum "
                    "(the same global batch), or use train.distributed: fsdp"
                ) from None
        micro_batches = back_off(run, position)  # outside the except block: its traceback keeps the failed step's activations alive


def back_off(run: Run, position: dict) -> list[Batch]:
    """Divide the micro-batch by its smallest factor, multiply accumulation by it (same global batch)."""
    b = run.loader.batch_size
    if b == 1:
        raise OutOfMemory(
            f"out of memory at step {run.step + 1} even with a micro-batch of 1 row "
            f"(data.max_length={run.cfg.data.max_length}); lower data.max_length, use model.method: lora, "
            "or free memory on the device"
        )
    f = smallest_factor(b)
    run.optimizer.zero_grad(set_to_none=True)  # the failed attempt's partial gradients
    if run.device.type == "cuda":
        torch.cuda.empty_cache()  # hand the failed attempt's blocks back before the retry allocates
    run.loader.load_state_dict(position)
    run.loader.batch_size = b // f
    run.grad_accum *= f
    run.batches = iter(run.loader)
    event = {"step": run.step + 1, "micro_batch_size": b // f, "grad_accum": run.grad_accum}
    run.counters.oom_backoffs.append(event)
    run.metrics.event("oom_backoff", event["step"], micro_batch_size=b // f, grad_accum=run.grad_accum)
    run.reporter.warn(
        f"out of memory at step {run.step + 1} with micro-batch {b}: retrying the step with micro-batch "
        f"{b // f} x accumulation {run.grad_accum} (global batch unchanged); later steps and a resume keep it"
    )
    return fetch_step(run)
