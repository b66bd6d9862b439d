"""``trainforge doctor``'s rerun line says what the same ``train`` command does in each state: refused while a
process holds the directory, nothing for a finished run, a resume from the checkpoint resume would pick (its own
checks: a damaged newest one is skipped), a new start from step 0; a run that ended during set-up and one a second
signal ended are named as such."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from test_resume import config, crash_in_step, flip_inside_largest_tensor, reference, reference_run, train  # noqa: F401 - fixtures

from trainforge.stop import Interrupted
from trainforge.rundir.lock import hold_run_dir
from trainforge.tools.doctor import diagnose, render


def killed(run: Path) -> Path:
    """``run`` as a SIGKILL after its last checkpoint, before final/ and summary.json, leaves it."""
    (run / "summary.json").unlink()
    shutil.rmtree(run / "final")
    return run


def test_a_flipped_byte_in_the_newest_checkpoint_is_skipped_by_doctor_as_by_resume(config, reference):
    """Doctor checked only state.pt's size and said 'resumes there' while train skipped it for the previous one."""
    run = killed(reference)
    flip_inside_largest_tensor(run / "checkpoints" / "step-00000006" / "state.pt")
    d = diagnose(run)
    assert d["last_checkpoint"]["step"] == 6 and d["resumes_from"]["step"] == 4
    assert d["damaged_checkpoints"][0].startswith("step-00000006: state.pt is damaged")
    assert "resumes from step-00000004 (step 4; 2 logged steps after it are trained again)" in d["rerun"]
    _, log = train(config, run)
    assert "skipping checkpoint" in log and "resuming from" in log and "step-00000004" in log


def test_a_finished_run_reruns_into_nothing_and_a_live_one_is_refused(config, reference):
    d = diagnose(reference)
    assert d["state"] == "finished" and "trains nothing (the run finished)" in d["rerun"]
    run = killed(reference)
    with hold_run_dir(run):  # this process holds the lease, as a live run does
        d = diagnose(run)
    assert d["state"].startswith("running") and "is refused (exit 2) while that process holds" in d["rerun"]
    assert "rerun: the same command" in render(d)


def test_without_a_checkpoint_a_stopped_or_failed_run_starts_again_and_a_finished_one_is_refused(reference):
    shutil.rmtree(reference / "checkpoints")
    d = diagnose(reference)
    assert "is refused (exit 2)" in d["rerun"] and "holds a finished run" in d["rerun"]

    killed(reference)
    with open(reference / "events.jsonl", "a") as f:  # a non-finite stop (exit 3) before any checkpoint
        f.write(json.dumps({"event": "error", "step": 6, "type": "NonFiniteError", "message": "nan", "exit_code": 3}) + "\n")
    d = diagnose(reference)
    assert d["state"].startswith("failed at step 6 (exit code 3)")
    assert "starts again from step 0 (this attempt's files move to attempts/N/); fix what failed it first" in d["rerun"]


def test_a_run_that_ended_during_set_up_is_diagnosed_not_refused(tmp_path):
    """Stopped while tokenizing or loading the model, the directory holds .trainforge-run and config.yaml: doctor
    exited 2 with 'no metrics.jsonl there; is it a trainforge run directory'."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".trainforge-run").write_text("a trainforge run directory\n")
    (run / "config.yaml").write_text("train:\n  max_steps: 30\n")
    d = diagnose(run)
    assert d["state"].startswith("ended during set-up") and d["last_step"] == 0
    assert d["rerun"] == f"the same command with --output {run} starts again from step 0"
    assert "state: ended during set-up" in render(d)


def test_a_second_signal_is_named_not_taken_for_a_sigkill(reference):
    """A SIGTERM (finish the step, save), then a second one (stop at once): doctor said 'killed (SIGKILL, out of
    memory, a lost node)'. The first signal is in events.jsonl as it comes."""
    run = killed(reference)
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": "start", "step": 6, "max_steps": 8}) + "\n")
        f.write(json.dumps({"event": "signal", "step": 7, "signal": "SIGTERM"}) + "\n")
    d = diagnose(run)
    assert d["state"].startswith("asked to stop by SIGTERM at step 7, then ended before saving (a second signal")
    assert "resumes from step-00000006" in d["rerun"]


def test_a_signal_is_recorded_in_events_when_it_comes(config, tmp_path, monkeypatch):
    crash_in_step(monkeypatch, 3, signal.SIGINT)
    with pytest.raises(Interrupted, match="SIGINT at step 3: checkpoint step-00000003 saved"):
        train(config, tmp_path / "run")
    kinds = [(e["event"], e["step"]) for e in map(json.loads, (tmp_path / "run" / "events.jsonl").read_text().splitlines())]
    assert ("signal", 2) in kinds and kinds.index(("signal", 2)) < kinds.index(("stop", 3))


def test_a_large_checkpoint_is_read_only_on_verify(config, reference, monkeypatch):
    """Reading a full fine-tune's state (tens of GB, twice: checksums, then values) made doctor take minutes: above
    VERIFY_BYTES it checks that the newest is complete and says it did not read it; --verify reads it."""
    import trainforge.tools.doctor as doctor

    run = killed(reference)
    flip_inside_largest_tensor(run / "checkpoints" / "step-00000006" / "state.pt")
    monkeypatch.setattr(doctor, "VERIFY_BYTES", 1)
    d = diagnose(run)
    assert not d["checkpoints_verified"] and d["resumes_from"]["step"] == 6 and "not read (large): --verify" in render(d)
    d = diagnose(run, verify=True)
    assert d["checkpoints_verified"] and d["resumes_from"]["step"] == 4
