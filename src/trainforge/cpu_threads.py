"""How many threads torch computes with on a CPU (``train.cpu_threads``).

torch starts one thread per core, and each parallel op ends at a barrier where every thread waits
for the slowest. When another process keeps a core busy, the thread on that core runs only when the
scheduler gives it a time slice, so every op waits up to one slice (about 4-16 ms on Linux) for it:
a 2-core machine with the other core busy ran a small Llama's step 58 times slower on 2 threads
than on 1. ``auto`` times a small matmul on the process's thread count and on one thread, and takes
the most threads that do not stall at the barrier; the run checks again at log steps (at most every
``RECHECK_S``), so threads come back when the other work ends and go when it starts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROBE_SIZE = 192  # a 14 MFLOP matmul: large enough that torch splits it over every thread, ~0.3 ms on one core
PROBE_REPS = 9
STALL_FACTOR = 2.0  # a thread count this much slower than one thread (and by STALL_MARGIN_S) waits at the barrier
STALL_MARGIN_S = 0.5e-3
RECHECK_S = 30.0


def probe_seconds(threads: int, reps: int = PROBE_REPS) -> float:
    """Median seconds of one ``PROBE_SIZE`` matmul on ``threads`` threads (left set afterwards)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)  # its own generator: the run's random stream must not see the probe
    a, b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen), torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen)
    torch.mm(a, b)  # warm-up: the thread pool wakes
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def candidates(available: int) -> list[int]:
    """Thread counts worth trying, most first: every count up to 8 cores, a few fractions above."""
    if available <= 8:
        return list(range(available, 0, -1))
    return sorted({available, available * 3 // 4, available // 2, available // 4, 1}, reverse=True)


def unstalled_threads(available: int, probe=probe_seconds) -> tuple[int, dict[int, float]]:
    """The most threads (of ``candidates(available)``) whose probe is not stalled against one thread's,
    and the probe times taken."""
    if available <= 1:
        return 1, {}
    times = {1: probe(1)}
    limit = max(STALL_FACTOR * times[1], times[1] + STALL_MARGIN_S)
    for n in candidates(available)[:-1]:
        times[n] = probe(n)
        if times[n] <= limit:
            return n, times
    return 1, times


@dataclass
class CpuThreads:
    """``train.cpu_threads`` for one process: ``setting`` is "auto" or a count; ``available`` the most
    threads auto may use (torch's count when the process started: one per core, or what the launcher or
    a test set). ``start()`` and ``recheck()`` return a line for the console when they change the count."""

    setting: int | str = "auto"
    active: bool = True  # False on a GPU, or where OMP_NUM_THREADS fixes the count: nothing to decide
    available: int = field(default_factory=torch.get_num_threads)
    checked_at: float = float("-inf")
    why: str = ""
    probe: Callable[[int], float] = field(default=probe_seconds, repr=False)  # seconds of the probe on n threads

    @classmethod
    def for_device(cls, setting: int | str, device: torch.device) -> CpuThreads:
        if device.type != "cpu":
            return cls(setting, active=False)
        if setting == "auto" and os.environ.get("OMP_NUM_THREADS"):  # the launcher (torchrun) or the user chose
            return cls(setting, active=False, why=f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
        return cls(setting)

    def start(self) -> str | None:
        """Set the thread count for the run's start; a line to say when auto took fewer than all."""
        if not self.active:
            return None
        if self.setting != "auto":
            torch.set_num_threads(int(self.setting))
            self.why = "train.cpu_threads"
            return None
        return self.recheck(force=True)

    def restore(self) -> None:
        """Give the process back the thread count it started with (a library caller keeps its setting)."""
        if self.active:
            torch.set_num_threads(self.available)

    def recheck(self, force: bool = False) -> str | None:
        """Under auto, probe again (at most every ``RECHECK_S``); a line when the count changed (or, at the
        start, when it is below the cores')."""
        now = time.perf_counter()
        if not self.active or self.setting != "auto" or (not force and now - self.checked_at < RECHECK_S):
            return None
        before = torch.get_num_threads()
        threads, times = unstalled_threads(self.available, self.probe)
        torch.set_num_threads(threads)
        self.checked_at = time.perf_counter()
        if threads == self.available:
            self.why = f"auto: all {threads}, no core busy" if threads > 1 else "auto"
            return f"cpu threads: {threads} of {self.available} (auto: the cores are free again)" if before != threads else None
        stalled = max(n for n in times if n > threads)
        self.why = (
            f"auto: {threads} of {self.available}, other work keeps cores busy (a matmul on {stalled} threads took "
            f"{times[stalled] * 1e3:.1f} ms against {times[1] * 1e3:.2f} ms on one, waiting at every op)"
        )
        if threads == before and not force:
            return None
        return f"cpu threads: {self.why}; set train.cpu_threads to fix a count"
