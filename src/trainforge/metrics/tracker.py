"""metrics.jsonl: one JSON object per logged step, flushed as it is written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# fields measured from the clock or the machine: they differ between identical runs, everything else must not
MEASURED_FIELDS = frozenset(
    {"tokens_per_s", "samples_per_s", "steps_per_s", "mfu", "data_wait_pct", "peak_memory_bytes", "reserved_memory_bytes", "elapsed_s"}
)


class MetricsLog:
    """Append-only JSONL writer; each line is complete on disk before training goes on.

    ``records`` counts the complete lines in the file, so a checkpoint can note how far the
    log had come and a resume can cut it back to exactly that point. Records also go to the
    optional sinks (TensorBoard).
    """

    def __init__(self, path: Path, sinks: list | None = None):
        self.path = path
        self.records = _complete_lines(path)
        self.sinks = [s for s in (sinks or []) if s is not None]
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        self.records += 1
        for sink in self.sinks:
            sink.write(record)

    def truncate(self, records: int) -> int:
        """Keep the first ``records`` lines (a torn last line goes too); returns how many were dropped."""
        with open(self.path, "rb") as f:
            data = f.read()
        end, kept = 0, 0
        while kept < records:
            nl = data.find(b"\n", end)
            if nl < 0:
                break
            end, kept = nl + 1, kept + 1
        dropped = _complete_lines(self.path) - kept
        self._file.flush()
        os.truncate(self.path, end)  # one call: the file is either cut or not
        self.records = kept
        return dropped

    def close(self) -> None:
        self._file.close()
        for sink in self.sinks:
            sink.close()


class NullMetricsLog:
    """What ranks other than 0 hold instead of a ``MetricsLog``: only rank 0 writes metrics."""

    records = 0

    def write(self, record: dict[str, Any]) -> None:
        pass

    def truncate(self, records: int) -> int:
        return 0

    def close(self) -> None:
        pass


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
