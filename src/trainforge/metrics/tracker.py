"""metrics.jsonl: one JSON object per logged step, flushed as it is written."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..rundir.atomic import atomic_write_bytes
from .sink import Sink

# fields measured from the clock or the machine: they differ between identical runs, everything else must not
MEASURED_FIELDS = frozenset(
    {"tokens_per_s", "samples_per_s", "steps_per_s", "mfu", "data_wait_pct", "peak_memory_bytes", "reserved_memory_bytes", "elapsed_s"}
)


EVENTS_FILE = "events.jsonl"


class MetricsLog:
    """Append-only JSONL writer; each line is complete on disk before training goes on.

    ``records`` counts the complete lines in the file; a resume cuts the file back to the records
    of its checkpoint's step and before (``keep_through``). Records also go to the
    trackers (``sinks.py``: TensorBoard, W&B, MLflow). What happened to the run besides its
    steps (a resume, a checkpoint and the pause it cost, an out-of-memory back-off, a stop on a
    signal) goes to ``events.jsonl`` beside it (``event``): never cut back, it tells the whole story.
    ``writing(path)``: the context every write of ``path`` runs in; a run passes ``rundir.writing``, so a
    write that fails (disk full) raises ``RunDirWriteError`` naming the file.
    """

    def __init__(
        self, path: Path, sinks: list[Sink | None] | None = None,
        writing: Callable[[Path], AbstractContextManager[Any]] = lambda path: contextlib.nullcontext(),
    ):
        self.path = path
        self.writing = writing
        self.records = _complete_lines(path)
        self.sinks = [s for s in (sinks or []) if s is not None]
        with writing(path):
            self._file = open(path, "a", encoding="utf-8")
        self.events_path = path.with_name(EVENTS_FILE)

    def write(self, record: dict[str, Any]) -> None:
        with self.writing(self.path):
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()
        self.records += 1
        for sink in self.sinks:
            sink.write(record)

    def keep_through(self, step: int, saved_records: int | None = None, finished: bool = False) -> tuple[int, int]:
        """Keep the records of steps up to ``step`` (a checkpoint's: the resumed run writes the later ones again);
        returns how many lines were dropped: (records of later steps, lines that are not records).

        By content, not by line count: a count saved with the checkpoint kept the first N lines, so one foreign
        or torn line before the checkpoint's step kept the garbage and dropped a valid record. Kept: every line
        that parses as a record of an integer ``step`` <= ``step``, in file order (an eval written after the
        checkpoint at its own step, as a finished run's final evaluation, is kept too: nothing writes it again).
        Records of ``step`` itself past the first ``saved_records`` records (the count the checkpoint saved: those
        written after its save) are kept only where the run ``finished``: a run killed while writing final/
        evaluates again, and its first final eval would be there twice.
        Dropped: later steps and lines that are not records (garbage, a torn last line). Where what is kept is the
        file's beginning, one truncate cuts the rest; otherwise the kept lines are written to a temporary file
        that replaces it (atomic), and the append handle is reopened on it."""
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.splitlines(keepends=True)
        steps = [_step_of(line) for line in lines]
        kept, records = [], 0
        for line, s in zip(lines, steps):
            if s is None:
                continue
            records += 1
            after_save = saved_records is not None and records > saved_records
            if s < step or (s == step and (finished or not after_save)):
                kept.append(line)
        end = sum(len(line) for line in kept)
        with self.writing(self.path):
            self._file.flush()
            if data[:end] == b"".join(kept):
                os.truncate(self.path, end)  # one call: the file is either cut or not
            else:
                atomic_write_bytes(self.path, b"".join(kept))
                self._file.close()
                self._file = open(self.path, "a", encoding="utf-8")
        self.records = len(kept)
        unreadable = steps.count(None)
        return len(lines) - len(kept) - unreadable, unreadable

    def event(self, event: str, step: int, **fields: Any) -> None:
        """Append ``{"event": event, "step": step, "time": unix time, **fields}`` to events.jsonl."""
        line = json.dumps({"event": event, "step": step, "time": round(time.time(), 3), **fields})
        with self.writing(self.events_path), open(self.events_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def summary(self, summary: dict[str, Any]) -> None:
        """summary.json, at the end of the run, to the trackers."""
        for sink in self.sinks:
            sink.summary(summary)

    def artifact(self, path: Path) -> None:
        """A file of the run (report.html) to the trackers that keep files."""
        for sink in self.sinks:
            sink.artifact(path)

    def tracker_state(self) -> dict[str, Any]:
        """Per tracker, what a resume needs to continue the same tracker run (kept in checkpoints)."""
        return {sink.name: sink.state() for sink in self.sinks if sink.state()}

    def close(self, ok: bool = True) -> None:
        """``ok``: the run finished (trackers mark it so); otherwise it failed or stopped."""
        try:
            self._file.close()
        except OSError:  # a line that failed to flush (disk full) was reported when it failed; the rest is on disk
            pass
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(ok)


class NullMetricsLog:
    """What ranks other than 0 hold instead of a ``MetricsLog``: only rank 0 writes metrics."""

    records = 0

    def write(self, record: dict[str, Any]) -> None:
        pass

    def keep_through(self, step: int, saved_records: int | None = None, finished: bool = False) -> tuple[int, int]:
        return 0, 0

    def event(self, event: str, step: int, **fields: Any) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def artifact(self, path: Path) -> None:
        pass

    def tracker_state(self) -> dict[str, Any]:
        return {}

    def close(self, ok: bool = True) -> None:
        pass


def _step_of(line: bytes) -> int | None:
    """The step of a metrics.jsonl line; None for a line that is not a complete record (garbage, torn, foreign)."""
    if not line.endswith(b"\n"):
        return None  # a torn last line, even where what was written of it parses
    try:
        record = json.loads(line)
    except ValueError:  # UnicodeDecodeError too
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _complete_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_events(path: Path, unreadable: list[str] | None = None) -> list[dict[str, Any]]:
    """All complete records of an events.jsonl file; none when it does not exist. Lines that hold JSON but not an
    object are skipped, and counted in ``unreadable`` when given."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    events, others = [], 0
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a crash
            continue
        if isinstance(event, dict):
            events.append(event)
        else:
            others += 1
    if others and unreadable is not None:
        unreadable.append(f"{path}: {others} line(s) hold JSON that is not an object; skipped")
    return events
