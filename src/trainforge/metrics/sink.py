"""What every tracker is (the ``Sink`` protocol) and the helpers trackers share; imports nothing of ours.

A tracker beside metrics.jsonl (TensorBoard, Weights & Biases, MLflow) gets the same scalars as
metrics.jsonl (``scalars``), the resolved config (``flat_config`` where it keeps ``section.key``
params) and, at the end, summary.json. The tracker modules import this module only; the factory
that picks them (``sinks.build_sinks``) imports them, so no import goes back up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    """A tracker: ``MetricsLog`` hands it every record it writes; only rank 0 holds any."""

    name: str  # as in ``log.report_to``: tensorboard | wandb | mlflow
    where: str  # one line for the console: where the tracker's run is and how to open it

    def write(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record (train, eval or profile)."""

    def summary(self, summary: dict[str, Any]) -> None:
        """summary.json's fields, at the end of the run."""

    def artifact(self, path: Path) -> None:
        """A file of the run (report.html), for trackers that keep files."""

    def state(self) -> dict[str, Any]:
        """What a resume needs to continue the same tracker run (kept in checkpoints); ``{}``: nothing."""

    def close(self, ok: bool = True) -> None:
        """``ok``: the run finished; otherwise it failed or stopped."""


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
    """A nested config as ``section.key`` -> value, in the config's order.

    Lists, None and empty dicts stay values (``{"a": {}}`` -> ``{"a": {}}``); ``prefix`` names
    ``node`` itself (``flat_config(d["model"], "model")`` -> ``model.name``, ...), and a node that
    is not a non-empty dict is ``{prefix: node}``.
    """
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flat_config(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}
