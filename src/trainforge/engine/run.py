"""The state of one run: what setup builds, the loop advances and finish reports."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..data.loader import Batch, TrainLoader
from ..dist import DistContext
from ..hardware import Precision
from ..metrics.console import ConsoleReporter
from ..metrics.profile import StepTimer
from ..metrics.tracker import MetricsLog
from ..metrics.window import LogWindow
from .compile_auto import CompileAuto
from .nonfinite import NonFiniteGuard
from .preempt import StopRequest
from .resume import capture_state
from .saver import Checkpointer


@dataclass
class RunResult:
    output_dir: Path
    summary: dict[str, Any]
    model: torch.nn.Module
    tokenizer: Any


@dataclass
class Run:
    """Everything a run holds between setup and finish; the loop reads and advances it."""

    cfg: RunConfig
    out: Path
    reporter: ConsoleReporter
    device: torch.device
    precision: Precision
    tokenizer: Any
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    loader: TrainLoader
    eval_set: list[Batch]
    metrics: MetricsLog
    max_steps: int
    data_format: str
    data_stats: dict[str, int]
    saver: Checkpointer
    guard: NonFiniteGuard
    window: LogWindow
    stop: StopRequest
    grad_accum: int  # micro-batches per step: train.grad_accum, multiplied after an out-of-memory back-off
    schedule_steps: int  # horizon of the LR schedule: max_steps, or the original one after a resume
    timer: StepTimer = field(default_factory=lambda: StepTimer(torch.device("cpu")))  # phases of profiled steps
    compiled: bool = False  # the decoder runs through torch.compile
    compile_auto: CompileAuto | None = None  # when to compile (train.compile), from this machine's past measurements
    flops_per_token: float = 0.0  # model FLOPs per trained token (forward + backward), for MFU
    peak_flops: float = 0.0  # of the device in the run's precision; 0: unknown, no MFU
    dist: DistContext = field(default_factory=DistContext)
    train_model: torch.nn.Module | None = None  # what the step runs: the DDP wrapper, else ``model`` itself
    sync: Any = None  # sync(last): context of a micro-batch's backward (gradient exchange on the last only)
    batches: Iterator[Batch] | None = None
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    data_wait_s: float = 0.0
    loop_time_s: float = 0.0
    last_train_loss: float | None = None
    eval_before: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    oom_backoffs: list[dict[str, int]] = field(default_factory=list)
    resumed_from: int | None = None
    precision_reason: str = ""  # why this precision: configured, or what `auto` found on this device
    choices: dict[str, Any] = field(default_factory=dict)  # what auto settings resolved to and why (summary.json)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds (LoRA: adapter weights only); see ``resume.capture_state``."""
        return capture_state(self)

