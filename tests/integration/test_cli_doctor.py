"""`trainforge doctor` through the real CLI: a run killed with SIGKILL, the same run finished, a directory that is no run;
runs stopped or killed before their first checkpoint, which the same command starts again."""

from __future__ import annotations

import json
import signal

from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config


def doctor_config(tmp_path, finetune_config: dict, steps: int, every: int, report: bool):
    """The fine-tune config at ``steps`` steps, a checkpoint every ``every``, every step logged."""
    cfg = {**finetune_config, "train": {**finetune_config["train"], "max_steps": steps},
           "checkpoint": {"every_steps": every}, "log": {"every_steps": 1, "report": report}}
    return write_config(tmp_path / "c.yaml", cfg)


def test_doctor_on_a_killed_run_names_the_step_the_checkpoint_and_the_limits(tmp_path, finetune_config):
    config = doctor_config(tmp_path, finetune_config, steps=12, every=3, report=False)
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


def test_a_run_stopped_or_killed_before_its_first_checkpoint_starts_again_with_the_same_command(tmp_path, finetune_config):
    """SIGTERM during the evaluation before training said 'to go on, run the same command', and that command exited 2
    (the eval had written metrics.jsonl; now it stops at its next batch, writing nothing); a SIGKILL before the first
    checkpoint left a directory refused forever (now the attempt moves to attempts/1 and the run starts again)."""
    config = doctor_config(tmp_path, finetune_config, steps=4, every=2, report=True)
    run = tmp_path / "t5"
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_eval": "SIGTERM"})
    assert proc.returncode == 75 and f"run the same command with --output {run}" in " ".join(proc.stderr.split()), show(proc)
    d = json.loads(run_cli(["doctor", run, "--json"], tmp_path).stdout)
    assert d["state"] == "stopped by SIGTERM" and "starts again from step 0" in d["rerun"], d

    metrics = run / "metrics.jsonl"
    assert not metrics.is_file() or not metrics.read_text().strip()  # the evaluation stopped at its first batch
    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4] and records[0] == {**records[0], "step": 0}
    d = json.loads(run_cli(["doctor", run, "--json"], tmp_path).stdout)
    assert d["state"] == "finished" and d["last_step"] == 4

    killed = tmp_path / "killed"
    proc = run_cli(["train", config, "--output", killed], tmp_path, faults={"signal_in_step": [2, "SIGKILL"]})
    assert proc.returncode == -signal.SIGKILL, show(proc)
    proc = run_cli(["doctor", killed], tmp_path)
    assert "killed" in proc.stdout and "starts again from step 0" in " ".join(proc.stdout.split()), show(proc)
    proc = run_cli(["train", config, "--output", killed], tmp_path)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and f"{killed}: no checkpoint (stopped before its first one): starting again from step 0" in text, show(proc)
    assert (killed / "attempts" / "1" / "metrics.jsonl").is_file() and (killed / "report.html").is_file()


def test_doctor_and_report_name_files_that_hold_json_but_not_objects_and_go_on(tmp_path):
    """summary.json holding [] (or lines of metrics.jsonl/events.jsonl holding a number) failed doctor, doctor --json
    and report with an AttributeError traceback; now each is named as unreadable and the rest is read."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / ".trainforge-run").write_text("a trainforge run directory\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "elapsed_s": 0.1}\n3\n{"step": 2, "loss": 1.5, "elapsed_s": 0.2}\n')
    (run / "events.jsonl").write_text('["start"]\n{"event": "start", "step": 0, "max_steps": 5}\n')
    (run / "summary.json").write_text("[]\n")
    (run / "checkpoints" / "step-00000002" / "meta.json").write_text('{"step": 2, "files": []}')
    (run / "checkpoints" / "step-00000002" / "state.pt").write_bytes(b"")

    proc = run_cli(["doctor", run, "--json"], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, show(proc)
    d = json.loads(proc.stdout)
    assert d["last_step"] == 2 and d["max_steps"] == 5 and d["state"].startswith("ended without a summary"), d
    notes = " ".join(d["unreadable"])
    assert "summary.json: holds a JSON array" in notes and "metrics.jsonl: 1 line(s)" in notes, notes
    assert "events.jsonl: 1 line(s)" in notes, notes
    assert d["incomplete_checkpoints"] == ['step-00000002: meta.json is unreadable (its "files" is not an object)'], d

    proc = run_cli(["doctor", run], tmp_path)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and f"unreadable: {run / 'summary.json'}: holds a JSON array" in text, show(proc)

    proc = run_cli(["report", run], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, show(proc)
    assert "warning:" in proc.stderr and "summary.json: holds a JSON array" in " ".join(proc.stderr.split()), show(proc)
    assert "holds a JSON array" in (run / "report.html").read_text()
