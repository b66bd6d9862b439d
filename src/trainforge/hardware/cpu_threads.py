"""How many threads torch computes with on a CPU (``train.cpu_threads``).

torch starts one thread per core, and each parallel op ends at a barrier where every thread waits
for the slowest. When another process keeps a core busy, the thread on that core runs only when the
scheduler gives it a time slice, so every op waits up to one slice (about 4-16 ms on Linux) for it:
a 2-core machine with the other core busy ran a small Llama's step 58 times slower on 2 threads
than on 1. ``auto`` times a matmul on the process's thread count and on one thread, and takes the most
threads that are clearly faster than one; it takes fewer than all only where other processes keep cores
busy (``/proc/stat``) and a median of interleaved timings agrees, so one noisy timing on an idle machine
does not halve a run. The run checks again at log steps (at most every ``RECHECK_S``), so threads come
back when the other work ends and go when it starts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROBE_SIZE = 384  # a 113 MFLOP matmul (~1.5 ms on one core): split over every thread, and long enough that
# the scheduler spreads the threads over the cores the way it does for a training step's ops
PROBE_WINDOW_S = 0.03  # each count is timed this long: a busy core takes its thread away only now and then, so a
# few repetitions (or their median) can miss the stall that a whole step meets
MIN_REPS = 3
NEEDED_SPEEDUP = 1.25  # n threads are kept only this much faster than one: beside a busy core they are no faster
# (two threads sharing the free core) or far slower (one of them on the busy core, waited for at every op)
RECHECK_S = 30.0
LOAD_WINDOW_S = 0.25  # /proc/stat counts in 10 ms ticks: 25 per core in this window, so a busy core reads 0.9-1.1
IDLE_CORES = 0.25  # other processes using less than this many cores' worth: nothing holds a core, whatever a probe said
ROUNDS = 3  # timings of all threads against one, interleaved, whose median must agree before a step down


def probe_seconds(threads: int, window_s: float = PROBE_WINDOW_S) -> float:
    """Mean seconds of a ``PROBE_SIZE`` matmul on ``threads`` threads (left set afterwards), repeated for
    ``window_s`` (at least ``MIN_REPS`` times): the mean counts the stalls a median would hide."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)  # its own generator: the run's random stream must not see the probe
    a, b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen), torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen)
    torch.mm(a, b)  # warm-up: the thread pool wakes
    reps, start = 0, time.perf_counter()
    while reps < MIN_REPS or time.perf_counter() - start < window_s:
        torch.mm(a, b)
        reps += 1
    return (time.perf_counter() - start) / reps


def candidates(available: int) -> list[int]:
    """Thread counts worth trying, most first: every count up to 8 cores, a few fractions above."""
    if available <= 8:
        return list(range(available, 0, -1))
    return sorted({available, available * 3 // 4, available // 2, available // 4, 1}, reverse=True)


def _busy_seconds(cpus: set[int] | None) -> float:
    """CPU seconds that ``cpus`` (all where None) spent on anything but idle and I/O wait since boot; steal
    counts as busy (a hypervisor's other guests hold the core just as a process does)."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if not (name.startswith("cpu") and name[3:].isdigit()) or (cpus is not None and int(name[3:]) not in cpus):
                continue
            user, nice, system, _idle, _iowait, irq, softirq, steal = ([int(t) for t in ticks] + [0] * 8)[:8]
            total += user + nice + system + irq + softirq + steal
    return total / os.sysconf("SC_CLK_TCK")


def other_work_cores(window_s: float = LOAD_WINDOW_S) -> float | None:
    """Cores' worth of CPU time that other processes took on this process's cores over ``window_s`` (this
    process's own CPU time, its other threads', taken off); None where ``/proc/stat`` cannot say."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        busy, own, start = _busy_seconds(cpus), time.process_time(), time.perf_counter()
        time.sleep(window_s)
        busy, own = _busy_seconds(cpus) - busy, time.process_time() - own
    except (OSError, ValueError):
        return None
    # at most the cores: /proc/stat credits ticks in bursts (a loaded 2-core VM once read 3.9 cores over 20 ms,
    # steal accounted late), and more cores than there are is noise, not other work
    cores = len(cpus) if cpus else os.cpu_count() or 1
    return min(max(busy - own, 0.0) / (time.perf_counter() - start), float(cores))


def fastest_threads(available: int, probe=probe_seconds, others=other_work_cores) -> tuple[int, dict[int, float]]:
    """The most threads (of ``candidates(available)``) whose probe runs at least ``NEEDED_SPEEDUP`` times as
    fast as one thread's, and the probe times taken. Measured on a 2-core machine: idle, 2 threads took
    0.43-0.58 of one thread's time; beside one spinning process, 1.1 of it (both threads on the free core)
    or 90 times it (one thread on the busy core). One timing each is easily thrown (just after other
    processes ended, 2 threads once took 1.47 ms against 1.10 on one on an idle machine, and a run went at
    half speed until its first recheck): fewer than all are taken only where ``others()`` (cores that other
    processes keep busy; None: unknown) is not idle and the median of ``ROUNDS`` interleaved timings of all
    threads against one agrees."""
    if available <= 1:
        return 1, {}
    times = {1: probe(1)}
    chosen = 1
    for n in candidates(available)[:-1]:
        times[n] = probe(n)
        if times[n] * NEEDED_SPEEDUP <= times[1]:
            chosen = n
            break
    if chosen == available:
        return chosen, times
    busy = others()
    if busy is not None and busy < IDLE_CORES:
        return available, times  # nothing else runs here: the timing was noise
    ratios = [times[available] / times[1]]
    for _ in range(ROUNDS - 1):
        one = probe(1)
        ratios.append(probe(available) / one)
    if statistics.median(ratios) * NEEDED_SPEEDUP <= 1:
        return available, times
    return chosen, times


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
    others: Callable[[], float | None] = field(default=other_work_cores, repr=False)  # cores other processes keep busy

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
        threads, times = fastest_threads(self.available, self.probe, self.others)
        if threads != before and not force:  # a change mid-run only when a second probe agrees: one noisy
            again, times = fastest_threads(self.available, self.probe, self.others)  # probe must not cost 30 s at the wrong count
            threads = threads if again == threads else before
        torch.set_num_threads(threads)
        self.checked_at = time.perf_counter()
        if threads == self.available:
            self.why = f"auto: all {threads}, no core busy" if threads > 1 else "auto"
            return f"cpu threads: {threads} of {self.available} (auto: the cores are free again)" if before != threads else None
        slower = max(n for n in times if n > threads)
        self.why = (
            f"auto: {threads} of {self.available}, other work keeps cores busy (a matmul on {slower} threads took "
            f"{times[slower] * 1e3:.2f} ms against {times[1] * 1e3:.2f} ms on one)"
        )
        if threads == before and not force:
            return None
        return f"cpu threads: {self.why}; set train.cpu_threads to fix a count"
