"""Trackers beside metrics.jsonl (``log.report_to``): TensorBoard, Weights & Biases, MLflow.

Every tracker gets the same scalars as metrics.jsonl (``scalars``), the resolved config and,
at the end, summary.json. A tracker is a small object with ``write(record)``, ``summary(dict)``,
``artifact(path)``, ``state()`` (what a resume needs to continue the same tracker run; kept in
checkpoints) and ``close(ok)``. Only rank 0 builds them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..config import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
EXTRA = {"tensorboard": "tensorboard", "wandb": "trainforge[wandb]", "mlflow": "trainforge[mlflow]"}
MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackerMissing(ConfigError):
    """``log.report_to`` names a tracker whose package is not installed."""


def installed(tracker: str) -> bool:
    return importlib.util.find_spec(MODULE[tracker]) is not None


def require_trackers(names: list[str]) -> None:
    """Fail before any work when a tracker asked for in ``log.report_to`` is not installed."""
    missing = [n for n in names if not installed(n)]
    if missing:
        pkgs = " ".join(f"'{EXTRA[n]}'" for n in missing)
        raise TrackerMissing(
            f"log.report_to: {', '.join(missing)} asked for but not installed; install it with "
            f"`pip install {pkgs}`, or drop it from log.report_to"
        )


def scalars(record: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """(group, {name: value}) of a metrics.jsonl record: its numeric fields but ``step``, nested
    dicts flattened with ``/`` (``profile/data_s``); group ``eval`` for eval records, else ``train``."""
    group = "eval" if any(k.startswith("eval_") for k in record) else "train"
    out: dict[str, float] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}/{k}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)

    for key, value in record.items():
        if key != "step":
            add(key, value)
    return group, out


def flat_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``section.key`` -> value (lists and None kept as values)."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flat_config(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


class TensorBoardSink:
    """Scalars under ``train/`` (or ``eval/``) in ``tb/`` of the run directory."""

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


def build_sinks(
    names: list[str],
    explicit: bool,
    out: Path,
    run_name: str,
    project: str,
    config: dict[str, Any],
    resume: dict[str, Any] | None = None,
) -> list[Any]:
    """The trackers ``names`` for run directory ``out``. ``explicit``: asked for in ``log.report_to``
    (a missing package is an error; otherwise TensorBoard is skipped when absent). ``resume``:
    the ``state()`` of each tracker from the checkpoint being resumed, to continue the same runs."""
    if explicit:
        require_trackers(names)
    resume = resume or {}
    sinks: list[Any] = []
    try:
        for name in names:
            if name == "tensorboard":
                sinks.append(TensorBoardSink.create(out / "tb"))
            elif name == "wandb":
                from .wandb_sink import WandbSink

                sinks.append(WandbSink(out, run_name, project, config, resume.get("wandb")))
            elif name == "mlflow":
                from .mlflow_sink import MlflowSink

                sinks.append(MlflowSink(out, run_name, project, config, resume.get("mlflow")))
    except BaseException:
        for sink in sinks:
            if sink is not None:
                sink.close(ok=False)
        raise
    return [s for s in sinks if s is not None]
