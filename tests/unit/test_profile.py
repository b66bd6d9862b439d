"""log.profile_steps gives a time split and a trace; TensorBoard gets the same scalars as metrics.jsonl."""

from __future__ import annotations

import json

from rich.console import Console

from trainforge.config import RunConfig
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.tracker import read_metrics


def test_profiled_step_splits_time_and_writes_a_trace(finetune_config, tmp_path):
    finetune_config["log"]["profile_steps"] = [3]
    train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    profiles = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "profile" in r]
    assert [p["step"] for p in profiles] == [3]
    assert set(profiles[0]["profile"]) == {"data_s", "forward_s", "backward_s", "optimizer_s"}
    assert all(v > 0 for v in profiles[0]["profile"].values())
    trace = json.loads((tmp_path / "run" / "profile" / "step-00000003.json").read_text())
    assert trace["traceEvents"]


def test_tensorboard_scalars(finetune_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "train/mfu", "eval/eval_loss"} <= tags
    logged = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [e.step for e in events.Scalars("train/loss")] == [r["step"] for r in logged]
    assert [round(e.value, 5) for e in events.Scalars("train/loss")] == [round(r["loss"], 5) for r in logged]
