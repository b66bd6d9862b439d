"""metrics.jsonl: one JSON object per logged step, flushed as it is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only JSONL writer; each line is complete on disk before training goes on."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
