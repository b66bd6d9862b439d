"""MLflow tracker: a run in experiment ``log.project`` of ``MLFLOW_TRACKING_URI``, else of the
file store ``./mlruns`` (the working directory's, as MLflow itself defaults to).

MLflow 3 keeps the file store in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE`` is set: we set it for a local store we chose (``mlflow-skinny``,
our extra, has no database backend). The run id and the store are kept in checkpoints, so a
resume continues the same run in the same store even from another working directory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .sink import flat_config, scalars

MAX_BATCH = 100  # MLflow's limit of params per log_batch call (metrics: 1000)


def tracking_uri(resume: dict[str, Any] | None) -> str:
    """``MLFLOW_TRACKING_URI``, else the resumed run's store, else ``./mlruns`` as a file URI."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or (resume or {}).get("tracking_uri")
    return uri or Path("mlruns").resolve().as_uri()


def _is_local_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri


class MlflowSink:
    name = "mlflow"

    def __init__(self, out: Path, run_name: str, experiment: str, config: dict[str, Any], resume: dict[str, Any] | None):
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(resume)
        if _is_local_file_store(self.uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        self.out = out
        run_id = (resume or {}).get("run_id")
        existing = self._find(run_id) if run_id else None
        if existing is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            self.where = f"MLflow run {run_id} continued in {self.uri}"
        else:
            exp_id = self._experiment(experiment)
            run = self.client.create_run(exp_id, run_name=run_name, tags={"trainforge.run_dir": str(out.resolve())})
            self.run_id = run.info.run_id
            lost = f" (run {run_id} of the checkpoint is not in this store)" if run_id else ""
            self.where = f"MLflow run {self.run_id} in {self.uri}, experiment {experiment!r}{lost}"
        self._log_params(config, existing.data.params if existing is not None else {})

    def _find(self, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException:
            return None

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another run created it meanwhile
            return self.client.get_experiment_by_name(name).experiment_id

    def _log_params(self, config: dict[str, Any], logged: dict[str, str]) -> None:
        """The resolved config as ``section.key`` params; on a resume only keys not logged yet
        (MLflow params cannot change: a changed value, such as a longer max_steps, stays as first logged)."""
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in flat_config(config).items() if k not in logged]
        for i in range(0, len(params), MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_BATCH])

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        group, values = scalars(record)
        now, step = int(time.time() * 1000), int(record.get("step", 0))
        metrics = [Metric(f"{group}/{k}", v, now, step) for k, v in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def summary(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def artifact(self, path: Path) -> None:
        if path.exists():
            self.client.log_artifact(self.run_id, str(path))

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "KILLED")
