"""log.report_to with the real libraries, offline: W&B (offline run files) and MLflow (./mlruns file
store) hold the same scalars as metrics.jsonl, read back from what they wrote; a run stopped by
SIGTERM and resumed continues the same W&B run and MLflow run id (kept in the checkpoint)."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
from pathlib import Path

import pytest
from rich.console import Console

import trainforge.engine.trainer as trainer
from trainforge.config.run import ConfigError, LogSettings, RunConfig, load_config
from trainforge.stop import Interrupted
from trainforge.metrics.console import ConsoleReporter
from trainforge.engine.resume import fixed_settings
from trainforge.metrics.sink import flat_config, scalars
from trainforge.metrics.sinks import TrackerMissing, require_trackers
from trainforge.metrics.tracker import read_metrics
from trainforge.metrics.wandb_sink import wandb_mode

QUIET = ConsoleReporter(Console(quiet=True))


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No W&B login, no MLflow server; both write under tmp_path (the working directory)."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var, sub in (("WANDB_CONFIG_DIR", "wandb-config"), ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------- reading what the trackers wrote


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (run-ID.wandb): a 7-byte header (':W&B', magic,
    version), then LevelDB-log framing: 32 KiB blocks of chunks, each with a 7-byte header
    (checksum, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, parts, out = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def wandb_history(run_file: Path) -> list[dict]:
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def expected_scalars(run: Path) -> dict[tuple[str, int], float]:
    """(tracker key, step) -> value for every scalar of metrics.jsonl."""
    out = {}
    for record in read_metrics(run / "metrics.jsonl"):
        group, values = scalars(record)
        for key, value in values.items():
            out[(f"{group}/{key}", record["step"])] = value
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-12)


# ---------------------------------------------------------------- the tests


def test_wandb_and_mlflow_hold_metrics_jsonl_and_a_resume_continues_the_same_runs(offline, finetune_config, monkeypatch):
    pytest.importorskip("wandb")  # both are optional (trainforge[trackers]): the GPU image has neither
    MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

    cfg = {**finetune_config, "log": {"every_steps": 2, "report_to": ["wandb", "mlflow"], "report": False}}
    cfg["train"] = {**cfg["train"], "max_steps": 6}
    run = offline / "run"

    # 1. SIGTERM in step 3: the step finishes, step 3 is saved, the trackers are closed as stopped
    forward_backward = trainer.forward_backward_adaptive

    def signal_in_step_3(r, *args, **kwargs):
        if r.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward_backward(r, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward_adaptive", signal_in_step_3)
    with pytest.raises(Interrupted):
        trainer.train(RunConfig.model_validate(cfg), run, QUIET)
    monkeypatch.setattr(trainer, "forward_backward_adaptive", forward_backward)

    # 2. the same command resumes from step 3 and finishes
    trainer.train(RunConfig.model_validate(cfg), run, QUIET)
    expected = expected_scalars(run)
    assert {step for _, step in expected} == {0, 2, 4, 6}  # eval before training, train records, eval after
    assert ("train/loss", 6) in expected and ("eval/eval_loss", 6) in expected

    # MLflow: one run in ./mlruns, continued by the resume, with every scalar at its step
    client = MlflowClient(tracking_uri=(offline / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("trainforge")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    mlrun = runs[0]
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    logged = {}
    for key in mlrun.data.metrics:
        for m in client.get_metric_history(mlrun.info.run_id, key):
            logged[(key, m.step)] = m.value
    assert logged.keys() == expected.keys()
    assert all(same(logged[k], v) for k, v in expected.items())
    assert mlrun.data.params["optim.lr"] == "0.001" and mlrun.data.params["train.max_steps"] == "6"
    assert "summary.json" in [a.path for a in client.list_artifacts(mlrun.info.run_id)]

    # W&B: two offline segments (before and after the resume) of one run id
    segments = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(segments) == 2, segments
    assert len({p.name for p in segments}) == 1  # run-<same id>.wandb
    history = [row for seg in segments for row in wandb_history(seg)]
    got = {(k, row["step"]): v for row in history for k, v in row.items() if "/" in k}
    assert got.keys() == expected.keys()
    assert all(same(got[k], v) for k, v in expected.items())
    config = [r for seg in segments for r in wandb_records(seg) if r.WhichOneof("record_type") == "config"]
    run_records = [r.run for seg in segments for r in wandb_records(seg) if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in run_records} == {segments[0].name[4:-6]}
    assert any("optim" in item.key for r in config for item in r.config.update) or any(
        "optim" in item.key for r in run_records for item in r.config.update
    )
    summaries = {item.key: json.loads(item.value_json) for seg in segments for r in wandb_records(seg)
                 if r.WhichOneof("record_type") == "summary" for item in r.summary.update}
    assert summaries.get("steps") == 6 and summaries.get("resumed_from_step") == 3

    # the resume point and the stop are in events.jsonl
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("stop", "resume")] == [("stop", 3), ("resume", 3)]


def test_a_tracker_asked_for_but_missing_is_named_before_any_work(finetune_config, tmp_path, monkeypatch):
    monkeypatch.setattr("trainforge.metrics.sinks.installed", lambda name: name != "wandb")
    with pytest.raises(TrackerMissing, match=r"wandb asked for but not installed.*pip install 'trainforge\[wandb\]'"):
        require_trackers(["tensorboard", "wandb"])
    cfg = {**finetune_config, "log": {"report_to": ["wandb"]}}
    with pytest.raises(ConfigError, match=r"trainforge\[wandb\]"):
        trainer.train(RunConfig.model_validate(cfg), tmp_path / "run", QUIET)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before the data and the model


def test_report_to_default_and_the_older_tensorboard_key():
    assert LogSettings().trackers() == ["tensorboard"]
    assert LogSettings(tensorboard=False).trackers() == []
    assert LogSettings(report_to=[]).trackers() == []
    assert LogSettings(report_to=["mlflow", "wandb", "mlflow"]).trackers() == ["mlflow", "wandb"]
    assert LogSettings(tensorboard=False, report_to=["tensorboard"]).trackers() == ["tensorboard"]  # report_to wins
    with pytest.raises(ConfigError, match="log.report_to"):
        load_config(None, ["log.report_to=[comet]"])


def test_wandb_is_offline_unless_logged_in(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789\n")
    assert wandb_mode() == "online"
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_scalars_are_the_numeric_fields_of_a_record():
    group, values = scalars({"step": 3, "loss": 1.5, "mfu": None, "compiled": True, "profile": {"data_s": 0.1}, "example_indices": [[1]]})
    assert group == "train" and values == {"loss": 1.5, "profile/data_s": 0.1}
    assert scalars({"step": 4, "eval_loss": 2.0, "eval_ppl": 7.4})[0] == "eval"


def test_flat_config_names_nested_settings_section_dot_key():
    nested = {"model": {"path": "m", "lora": {"r": 8, "targets": ["q", "v"]}, "extra": {}}, "seed": None, "tags": []}
    assert list(flat_config(nested).items()) == [
        ("model.path", "m"), ("model.lora.r", 8), ("model.lora.targets", ["q", "v"]), ("model.extra", {}),
        ("seed", None), ("tags", []),
    ]  # lists, None and empty dicts stay values, in the config's order
    assert flat_config({"r": 8, "sub": {"k": 1}}, "lora") == {"lora.r": 8, "lora.sub.k": 1}  # prefix: the node's own name
    assert flat_config({}, "data") == {"data": {}} and flat_config([1, {"a": 2}], "x") == {"x": [1, {"a": 2}]}
    assert flat_config({}) == {"": {}} and flat_config({1: {2: 3}}) == {"1.2": 3}


def test_flat_config_names_the_settings_a_checkpoint_is_bound_to(finetune_config):
    """The ``section.key`` names and values of a checkpoint's fixed settings are flat_config's."""
    cfg = RunConfig.model_validate({**finetune_config, "model": {**finetune_config["model"], "method": "lora", "lora": {"target_modules": ["q_proj", "v_proj"]}}})
    d = cfg.model_dump(mode="json")
    flat = {k: v for section in ("model", "data", "optim") for k, v in flat_config(d[section], section).items()}
    fixed = {k: v for k, v in fixed_settings(cfg).items() if not k.startswith("train.")}
    assert fixed == {k: v for k, v in flat.items() if k not in ("data.cache_dir", "data.num_workers")}
    assert any(isinstance(v, list) for v in fixed.values())  # the LoRA target modules: a list kept whole
