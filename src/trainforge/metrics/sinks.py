"""Building the trackers that ``log.report_to`` asks for, and failing early when one is not installed.

What a tracker is (``Sink``) and the helpers trackers share (``scalars``, ``flat_config``) live in
``sink.py``, which the tracker modules import; this factory imports them (W&B and MLflow only when
asked for), so no import comes back here. Trackers: TensorBoard (``tensorboard_sink.py``),
Weights & Biases (``wandb_sink.py``), MLflow (``mlflow_sink.py``). Only rank 0 builds them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..config.run import ConfigError
from .sink import Sink, flat_config, scalars  # noqa: F401  (scalars, flat_config: importable from here as before)
from .tensorboard_sink import TensorBoardSink

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


def build_sinks(
    names: list[str],
    explicit: bool,
    out: Path,
    run_name: str,
    project: str,
    config: dict[str, Any],
    resume: dict[str, Any] | None = None,
) -> list[Sink]:
    """The trackers ``names`` for run directory ``out``. ``explicit``: asked for in ``log.report_to``
    (a missing package is an error; otherwise TensorBoard is skipped when absent). ``resume``:
    the ``state()`` of each tracker from the checkpoint being resumed, to continue the same runs."""
    if explicit:
        require_trackers(names)
    resume = resume or {}
    sinks: list[Sink | None] = []
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
