"""Optional metric sinks beside metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardSink:
    """Numeric fields of each record as scalars under ``train/`` (or ``eval/``), when tensorboard is installed."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    @classmethod
    def create(cls, log_dir: Path) -> "TensorBoardSink | None":
        try:
            return cls(log_dir)
        except ImportError:  # tensorboard not installed: metrics.jsonl alone
            return None

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        group = "eval" if any(k.startswith("eval_") for k in record) else "train"
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
