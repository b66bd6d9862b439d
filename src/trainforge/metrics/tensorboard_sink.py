"""TensorBoard tracker: the scalars of metrics.jsonl under ``train/`` (or ``eval/``) in ``tb/`` of the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .sink import scalars


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        self.where = f"TensorBoard scalars in {log_dir} (tensorboard --logdir {log_dir})"

    @classmethod
    def create(cls, log_dir: Path) -> "TensorBoardSink | None":
        try:
            return cls(log_dir)
        except ImportError:  # tensorboard not installed: metrics.jsonl alone
            return None

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        group, values = scalars(record)
        for key, value in values.items():
            self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        pass  # summary.json sits beside tb/ in the run directory

    def artifact(self, path: Path) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def close(self, ok: bool = True) -> None:
        self.writer.close()
