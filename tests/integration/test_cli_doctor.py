"""`trainforge doctor` through the real CLI: a run killed with SIGKILL, the same run finished, a directory that is no run."""

from __future__ import annotations

import json
import signal

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


def test_doctor_on_a_killed_run_names_the_step_the_checkpoint_and_the_limits(tmp_path, finetune_config):
    cfg = dict(finetune_config)
    cfg["train"] = {**cfg["train"], "max_steps": 12}
    cfg["checkpoint"] = {"every_steps": 3}
    cfg["log"] = {"every_steps": 1, "report": False}
    config = write_config(tmp_path / "c.yaml", cfg)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_step": [8, "SIGKILL"]})
    assert proc.returncode == -signal.SIGKILL, show(proc)

    proc = run_cli(["doctor", run, "--json"], tmp_path)
    assert proc.returncode == 0, show(proc)
    d = json.loads(proc.stdout)
    assert d["state"].startswith("ended without a summary") and "killed" in d["state"]
    assert d["last_step"] == 7 and d["max_steps"] == 12
    assert d["last_checkpoint"]["step"] == 6
    assert d["environment"]["torch"] and d["config"] == "valid"
    assert d["time"]["eval_s"] > 0 and d["time"]["wall_s"] > d["time"]["startup_s"] > 0
    assert d["limits"] and d["limits"][0]["seconds"] >= d["limits"][-1]["seconds"]
    assert d["estimate"]["at_step"] == 1 and d["estimate"]["projected_train_s"] > 0

    proc = run_cli(["doctor", run], tmp_path)
    text = " ".join(proc.stdout.split())
    assert "state: ended without a summary" in text and "at step 7 of 12" in text, show(proc)
    assert "step-00000006 (step 6)" in text and "1 logged steps after it are trained again" in text, show(proc)
    assert "what limited this run" in text and "advice given while it ran: none" in text, show(proc)

    proc = run_cli(["train", config, "--output", run], tmp_path)  # the rerun resumes and finishes
    assert proc.returncode == 0, show(proc)
    d = json.loads(run_cli(["doctor", run, "--json"], tmp_path).stdout)
    assert d["state"] == "finished" and d["last_step"] == 12
    assert d["limits"] == json.loads((run / "summary.json").read_text())["limits"]


def test_doctor_refuses_a_directory_that_holds_no_run(tmp_path):
    proc = run_cli(["doctor", tmp_path], tmp_path)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr, show(proc)
