"""When and how checkpoints are written: intervals, in the foreground or a background thread;
a failed save is reported, leaves earlier checkpoints intact and is retried at the next interval."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..rundir.checkpoint import save_checkpoint, scan_checkpoints, step_dir_name
from ..config.run import CheckpointSettings
from ..metrics.console import ConsoleReporter
from ..rundir.lock import check_writer

StateFn = Callable[[], dict[str, Any]]
Writer = Callable[[Path, int, dict[str, Any], dict[str, Any], int], Any]  # save_checkpoint's signature


def free_space(path: Path) -> str:
    """`` (12.3 MiB free on its disk)``: what a failed save's message adds, as the errors of torch.save do not say
    that the disk is full; empty when the disk cannot be asked."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return ""
    return f" ({free / 2**20:,.1f} MiB free on its disk)"


def cpu_snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are fresh CPU tensors, safe to write while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_snapshot(v) for v in obj)
    return obj  # numbers, strings, None: immutable


class Checkpointer:
    """Saves every ``every_steps`` / ``every_minutes`` and at the end; one save in flight at a time."""

    def __init__(
        self,
        root: Path,
        settings: CheckpointSettings,
        meta: dict[str, Any],
        reporter: ConsoleReporter,
        clock: Callable[[], float] = time.monotonic,
        writer: Writer = save_checkpoint,
    ):
        """``writer``: how a state reaches the disk (data-parallel: rank 0 only, or all ranks' shards)."""
        self.root, self.settings, self.meta, self.reporter, self.clock = root, settings, meta, reporter, clock
        self.writer = writer
        self.enabled = settings.every_steps is not None or settings.every_minutes is not None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if settings.async_ else None
        self._pending: tuple[int, Future, float] | None = None  # (step, write, pause it cost)
        self._last_time = self.clock()
        self.saved_step: int | None = None  # newest step saved successfully by this process
        self.saves, self.failures, self.stall_s = 0, 0, 0.0
        # on_event(name, step, **fields): each save (and the pause it cost) or failure, for events.jsonl
        self.on_event: Callable[..., None] = lambda event, step, **fields: None

    def time_due(self) -> bool:
        s = self.settings
        return s.every_minutes is not None and self.clock() - self._last_time >= s.every_minutes * 60

    def due(self, step: int, last: bool, time_due: bool | None = None) -> bool:
        """``time_due``: the time-based decision when given (ranks agree on one), else this clock's."""
        s = self.settings
        if not self.enabled:
            return False
        if last or (s.every_steps and step % s.every_steps == 0):
            return True
        return self.time_due() if time_due is None else time_due

    def maybe_save(self, step: int, last: bool, state: StateFn, time_due: bool | None = None) -> None:
        """Report a finished background save; save when an interval (or the end) is reached.

        Raises ``LeaseLost`` once another process took over the run directory (rundir/lock.py)."""
        check_writer(self.root)
        self._poll(wait=False)
        if self.due(step, last, time_due):
            self.save(step, state, background=self._pool is not None)

    def save(self, step: int, state: StateFn, background: bool = False) -> None:
        """Save step ``step``; the pause it costs training is measured and logged."""
        check_writer(self.root)  # never write a run directory another process took over
        t0 = time.perf_counter()  # the pause counts waiting for the previous background write, if any
        self._poll(wait=True)  # one save at a time: a slow disk must not pile up copies in memory
        self._last_time = self.clock()  # the next interval counts from this attempt, failed or not
        if background:
            snapshot = cpu_snapshot(state())
            future = self._pool.submit(self._write_timed, step, snapshot)
            self._pending = (step, future, time.perf_counter() - t0)
            return
        try:
            self.writer(self.root, step, state(), self.meta, self.settings.keep_last)
        except Exception as e:  # disk full, permissions, ...: training goes on, the next interval retries
            self._failed(step, e)
            return
        paused = time.perf_counter() - t0
        self._succeeded(step, paused, f"saved (training paused {paused:.2f}s)")

    def save_now(self, step: int, state: StateFn) -> bool:
        """Save in the foreground unless step ``step`` is already saved; True when it is on disk."""
        self._poll(wait=True)
        if self.saved_step != step:
            self.save(step, state)
        return self.saved_step == step

    def close(self) -> None:
        """Wait for a background save and report it."""
        self._poll(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def newest_complete(self) -> Path | None:
        """The newest complete checkpoint on disk, this run's or one it resumed from (a save in flight is waited
        for first); None when there is none."""
        self._poll(wait=True)
        complete, _ = scan_checkpoints(self.root)
        return complete[-1].path if complete else None

    def summary(self) -> dict[str, Any]:
        return {"checkpoint_saves": self.saves, "checkpoint_failures": self.failures, "checkpoint_stall_s": self.stall_s}

    def _poll(self, wait: bool) -> None:
        if self._pending is None:
            return
        step, future, paused = self._pending
        if not wait and not future.done():
            return
        self._pending = None
        try:
            took = future.result()
        except Exception as e:
            self._failed(step, e)
            return
        self._succeeded(step, paused, f"written in the background in {took:.2f}s (training paused {paused:.2f}s to copy it)")

    def _write_timed(self, step: int, snapshot: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.writer(self.root, step, snapshot, self.meta, self.settings.keep_last)
        return time.perf_counter() - t0

    def _succeeded(self, step: int, paused: float, how: str) -> None:
        self.saves += 1
        self.stall_s += paused
        self.saved_step = step
        self.reporter.info(f"checkpoint {step_dir_name(step)} {how}")
        self.on_event("checkpoint", step, pause_s=round(paused, 4))

    def _failed(self, step: int, error: Exception) -> None:
        self.failures += 1
        complete, _ = scan_checkpoints(self.root)
        kept = f"newest complete checkpoint: {complete[-1].path.name}" if complete else "no complete checkpoint yet"
        self.reporter.warn(
            f"saving checkpoint {step_dir_name(step)} failed: {error}{free_space(self.root)}. Earlier checkpoints are "
            f"intact ({kept}); retrying at the next interval"
        )
        # said first: recording it may fail too when the disk is full, and stop the run (RunDirWriteError)
        self.on_event("checkpoint_failed", step, error=str(error))
