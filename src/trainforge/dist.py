"""Data parallelism with torch.distributed: torchrun's environment, the process group, DDP / FSDP2
wrapping and the few reductions a run needs.

A single process gets a ``DistContext`` of world size 1 whose collectives are no-ops, so the
trainer has one code path. Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set) the
process group uses gloo on CPU and NCCL on GPU, with a timeout: a rank that dies or hangs makes
the others fail within that bound instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import TrainforgeError

MODES = ("ddp", "fsdp")
PATIENT_TIMEOUT_S = 7 * 24 * 3600.0  # rank 0's work before the others go on (tokenizing): unbounded in practice


class DistError(TrainforgeError, RuntimeError):
    """A distributed setting that cannot work (the CLI exits with code 2)."""


def peer_failure(e: BaseException) -> bool:
    """A collective that failed because another rank died, hung or closed its connections."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("connection closed by peer", "connection reset by peer"))


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class DistContext:
    """This process's place in the job and the collectives the trainer uses."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    mode: str = "none"  # none (one process) | ddp | fsdp: chosen by ``choose_mode`` once the model is built
    patient_group: Any = None  # gloo, without the job's collective timeout: ``main_first``'s wait (set by init_distributed)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------ collectives (no-ops alone)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, and returned; ``op``: sum | max."""
        if self.enabled:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (pickled: for small host-side values only)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (builds a cache, creates a directory), the others after it.

        The others wait on ``patient_group``, not under ``train.dist_timeout_s``: tokenizing a large corpus
        or computing reference log-probabilities can take rank 0 hours, and a waiting rank timed out at 600 s
        and ended the job. A rank 0 that dies still ends the wait at once (gloo sees its connection close)."""
        if not self.is_main:
            self._patient_barrier()
        try:
            yield
        finally:
            if self.is_main:
                self._patient_barrier()

    def _patient_barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.patient_group)

    def step_totals(self, n_targets: int, n_tokens: int, stop: bool, time_due: bool, device: torch.device) -> tuple[int, int, bool, bool]:
        """One tiny all-reduce per step: target and input tokens of all ranks, and whether any rank
        got a stop signal or reached a time-based checkpoint (all ranks must agree on both)."""
        if not self.enabled:
            return n_targets, n_tokens, stop, time_due
        t = torch.tensor([n_targets, n_tokens, int(stop), int(time_due)], dtype=torch.int64, device=device)
        self.all_reduce(t)
        a, b, c, d = t.tolist()  # host values are needed now: the loss divisor of this step's backward passes
        return a, b, c > 0, d > 0

    # ------------------------------------------------------------ model wrapping

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module the training step runs: DDP or FSDP2 around ``model``; ``model`` itself alone.

        Gradients are summed across ranks, not averaged: the loss is already divided by the
        target tokens of all ranks, so the sum is the gradient of the global mean.
        """
        if not self.enabled:
            return model
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            ddp.register_comm_hook(None, _allreduce_sum_hook)
            return ddp
        shard_fsdp2(model, device)
        return model

    def no_sync(self, train_model: torch.nn.Module) -> Callable[[bool], contextlib.AbstractContextManager]:
        """``sync(last)``: the context for a micro-batch's backward; gradients are exchanged only
        on the last micro-batch of a step (accumulating in place before it: less traffic)."""
        if not self.enabled:
            return lambda last: contextlib.nullcontext()
        if self.mode == "ddp":
            return lambda last: contextlib.nullcontext() if last else train_model.no_sync()

        @contextlib.contextmanager
        def fsdp_sync(last: bool) -> Iterator[None]:
            train_model.set_requires_gradient_sync(last)
            yield

        return fsdp_sync


def _allreduce_sum_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook: sum the gradient bucket (DDP's default averages it)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def shard_fsdp2(model: torch.nn.Module, device: torch.device) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, norm, head), in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):  # both setters below came in torch 2.8
        raise DistError(
            f"train.distributed: fsdp sums gradients with FSDP2's reduction setters, which torch {torch.__version__} "
            "lacks (2.8+): upgrade torch, or use train.distributed: ddp"
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:  # one all-gather per layer: only one layer's full weights live at a time
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in [*layers, model]:  # each sharded module reduces its own gradients
        m.set_gradient_divide_factor(1.0)  # sum, as DDP's hook above
        m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has neither AVG nor PREMUL_SUM


# ---------------------------------------------------------------- process group


def init_distributed(device_type: str, timeout_s: float) -> DistContext:
    """The context of this process: torchrun's environment and a process group, or world size 1."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ctx = DistContext(rank, local_rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                "start at most one process per GPU (--nproc_per_node)"
            )
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    # every rank creates it, in the same order; on CPU with no timeout of its own, so gloo and NCCL jobs alike
    ctx.patient_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, PATIENT_TIMEOUT_S)))
    return ctx


def shutdown(wait_for_peers: bool = True, timeout_s: float = 30.0) -> None:
    """Tear the process group down without risking a hang at exit.

    gloo's worker threads may still be releasing finished work that holds Python tensors, which
    needs the GIL. A thread that destroys the group joins those workers: if it held the GIL while
    doing so (as a destructor run from Python does) the two would wait for each other forever.
    So: free wrappers left in reference cycles while the group lives, wait until every rank is
    done, let the workers run (sleeping releases the GIL), then destroy the group from a helper
    thread that this one waits for with a bound. The CLI ends torchrun workers with ``os._exit``
    after this, so nothing left can hang the interpreter's own shutdown either.
    ``wait_for_peers``: false on a failure, where peers may be blocked in a collective this rank
    left (a barrier would wait for them until the timeout).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    # a failing rank is already on its way out with its error: torchrun's SIGTERM to the group must not turn that
    # exit into an interrupted one (exit 75, the error printed again in a traceback) while it tears down here
    ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)} \
        if not wait_for_peers and threading.current_thread() is threading.main_thread() else {}
    try:
        gc.collect()
        if wait_for_peers:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer that already failed: tear down what is left
                pass
        time.sleep(0.05)
        closer = threading.Thread(target=dist.destroy_process_group, name="trainforge-pg-shutdown", daemon=True)
        closer.start()
        closer.join(timeout_s)
    finally:
        for s, handler in ignored.items():
            signal.signal(s, handler)


def choose_mode(requested: str, static_bytes: int, available: int | None, local_world_size: int) -> tuple[str, str]:
    """(``ddp`` | ``fsdp``, why). ``auto``: DDP when weights, gradients and optimizer state fit on
    one device (on a CPU host, in its share of memory), else FSDP2 which shards them."""
    if requested in MODES:
        return requested, "as configured"
    if available is None:
        return "ddp", "memory unknown"
    share = available // local_world_size
    if static_bytes <= 0.8 * share:  # leave room for activations
        return "ddp", f"weights+grads+optimizer {static_bytes / 2**30:.2f} GiB fit in {share / 2**30:.2f} GiB"
    return "fsdp", f"weights+grads+optimizer {static_bytes / 2**30:.2f} GiB exceed 80% of {share / 2**30:.2f} GiB"


def device_for(requested: torch.device, ctx: DistContext) -> torch.device:
    """Each rank on its own GPU (``cuda:LOCAL_RANK``); CPU ranks share the CPU."""
    if requested.type == "cuda" and ctx.enabled:
        return torch.device("cuda", ctx.local_rank)
    return requested
