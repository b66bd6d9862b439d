"""The state of one run: what setup builds, the loop advances and finish reports; its checkpoint is the union of its parts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.run import RunConfig
from ..hardware.cpu_threads import CpuThreads
from ..data.loader import Batch, TrainLoader
from ..dist import DistContext
from ..hardware.device import Precision
from ..metrics.console import ConsoleReporter
from ..metrics.profile import StepTimer
from ..metrics.tracker import MetricsLog
from ..metrics.window import LogWindow
from .advisor import Advisor
from .compile_auto import CompileAuto
from .nonfinite import NonFiniteGuard
from ..stop import StopRequest
from .saver import Checkpointer
from .state import Counters, Stateful, TrainedWeights, capture_rng, rank_seed, restore_rng, resumed_grad_accum
from .step import TokenObjective


@dataclass
class RunResult:
    output_dir: Path
    summary: dict[str, Any]
    model: torch.nn.Module
    tokenizer: Any


@dataclass(frozen=True)
class RunFacts:
    """What setup found out about the run and reports in summary.json; fixed once the run starts."""

    precision_reason: str  # why this precision: configured, or what `auto` found on this device
    data_format: str
    data_stats: dict[str, Any]
    flops_per_token: float  # model FLOPs per trained token (forward + backward), for MFU
    peak_flops: float  # of all devices in the run's precision; 0: unknown, no MFU
    choices: dict[str, Any]  # what auto settings resolved to and why


@dataclass
class Run:
    """Everything a run holds between setup and finish: its components, the services it reports
    through, its counters and the facts setup found. The loop reads and advances it."""

    cfg: RunConfig
    out: Path
    max_steps: int
    # components
    device: torch.device
    precision: Precision
    tokenizer: Any
    model: torch.nn.Module
    train_model: torch.nn.Module | None  # what the step runs: the DDP/FSDP wrapper, else ``model`` itself
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    loader: TrainLoader
    eval_set: list[Batch]
    grad_accum: int  # micro-batches per step: train.grad_accum, multiplied after an out-of-memory back-off
    compile_auto: CompileAuto  # when to compile (train.compile), from this machine's past measurements
    # services
    reporter: ConsoleReporter
    metrics: MetricsLog
    saver: Checkpointer
    guard: NonFiniteGuard
    window: LogWindow
    stop: StopRequest
    dist: DistContext
    sync: Any  # sync(last): context of a micro-batch's backward (gradient exchange on the last only)
    facts: RunFacts
    timer: StepTimer = field(default_factory=lambda: StepTimer(torch.device("cpu")))  # phases of profiled steps
    counters: Counters = field(default_factory=Counters)
    compiled: bool = False  # the decoder runs through torch.compile
    batches: Iterator[Batch] | None = None  # the loader's iterator while the loop runs
    resumed_from: int | None = None
    eval_again: bool = False  # a signal stopped the evaluation at the resumed step: it runs before the next step
    # the checkpoint's loop, data-wait and eval seconds and skipped steps: spent by earlier processes of the run
    earlier: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0  # time.perf_counter() when setup began: summary.json's wall time
    startup_s: float | None = None  # setup began -> the loop first started, in this process
    startup_phases: dict[str, float] = field(default_factory=dict)  # seconds of set-up's phases (setup.py's Laps)
    advisor: Advisor = field(default_factory=lambda: Advisor(None))  # warns once per cause while the run goes
    objective: Any = field(default_factory=TokenObjective)  # train.objective: what a step sums and divides by
    # train.cpu_threads: fewer while other work keeps cores busy (checked again at log steps)
    cpu_threads: CpuThreads = field(default_factory=lambda: CpuThreads(active=False))

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.counters.step

    def weights(self) -> TrainedWeights:
        return TrainedWeights(self.model, self.optimizer, sharded=self.dist.mode == "fsdp")

    def parts(self) -> dict[str, Stateful]:
        """The parts whose own ``state_dict`` a checkpoint holds, under their keys in ``state.pt``."""
        return {"scheduler": self.scheduler, "loader": self.loader, "window": self.window, "nonfinite": self.guard}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds (LoRA: adapter weights only) to continue exactly where the run is now.

        Data-parallel: all ranks call it together; the random states of every rank are gathered
        (``rng_ranks``), and under FSDP model and optimizer are this rank's shards.
        """
        rng = capture_rng()
        return {
            **self.weights().state_dict(),
            **{name: part.state_dict() for name, part in self.parts().items()},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "micro_batch_size": self.loader.batch_size,  # after any out-of-memory back-off
            "grad_accum": self.grad_accum,
            "rng": rng,
            **({"rng_ranks": self.dist.all_gather_object(rng)} if self.dist.enabled else {}),
            "counters": {
                **self.counters.state_dict(),
                "metrics_records": self.metrics.records,
                "trackers": self.metrics.tracker_state(),  # W&B / MLflow run ids: a resume continues the same runs
            },
        }

    def load_state_dict(self, state: dict[str, Any], path: Path | None = None) -> None:
        """Continue from a checkpoint's state (``path``: its directory, where FSDP shards lie). Random
        states last: call it after everything that consumes them is built."""
        self.weights().load_state_dict(state, path)
        for name, part in self.parts().items():
            part.load_state_dict(state[name])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        # on another number of processes (resume.check_world allows it where train.global_batch_size holds the global
        # batch), the accumulation that keeps it: the same rows a step
        self.loader.batch_size = state["micro_batch_size"]
        self.grad_accum = resumed_grad_accum(state, self.dist.world_size)
        self.counters.load_state_dict(state["counters"])
        if "peak_flop_s" not in state["counters"]:  # written before the counter: its seconds at this run's peak
            self.counters.peak_flop_s = self.counters.loop_time_s * (self.facts.peak_flops or 0.0)
        self.resumed_from = self.counters.step
        c = self.counters
        self.earlier = {
            "loop_time_s": c.loop_time_s, "data_wait_s": c.data_wait_s, "eval_s": c.eval_s, "skipped": float(self.guard.total),
            "peak_flop_s": c.peak_flop_s,
        }
        ranks = state.get("rng_ranks") or [state["rng"]]
        restore_rng(ranks[self.dist.rank % len(ranks)])
        if self.dist.rank >= len(ranks):  # resumed on more processes: its own dropout masks, not another rank's
            torch.manual_seed(rank_seed(self.cfg.train.seed, self.dist.rank, self.counters.step))
