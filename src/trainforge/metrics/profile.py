"""Step-time breakdown (data, forward, backward, optimizer) and a torch profiler trace, on request."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch


class StepTimer:
    """Times named phases of a step. Inactive (free) except on profiled steps, where it
    synchronizes the device at each phase edge so GPU work is charged to its phase."""

    def __init__(self, device: torch.device):
        self.device = device
        self.active = False
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] += time.perf_counter() - start


class StepProfile:
    """One profiled step: activates the timer and records a profiler trace under ``trace_dir``."""

    def __init__(self, timer: StepTimer, step: int, trace_dir: Path):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if timer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.timer, self.step, self.trace = timer, step, trace_dir / f"step-{step:08d}.json"
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        timer.seconds.clear()
        timer.active = True
        self.prof.__enter__()

    def finish(self) -> dict[str, float]:
        """Stop, write the trace (open it in Perfetto or chrome://tracing), return the breakdown."""
        self.prof.__exit__(None, None, None)
        self.timer.active = False
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.trace))
        return {f"{k}_s": v for k, v in self.timer.seconds.items()}


NULL_TIMER = StepTimer(torch.device("cpu"))  # never activated: every phase() is a plain yield
