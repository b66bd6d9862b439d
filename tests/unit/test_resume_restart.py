"""The same command on a run directory that holds no checkpoint to continue: a run stopped or killed before
its first checkpoint starts again from step 0 (its files moved to attempts/N), where a finished run or a
directory trainforge did not write is refused. And the cut-back of metrics.jsonl on resume (by content), and
a run resumed at its last step (the window its checkpoint left open is logged)."""

from __future__ import annotations

import inspect
import json
import shutil
import signal
from pathlib import Path

import pytest
from test_resume import (  # noqa: F401 - fixtures
    Crash,
    assert_same_weights_and_optimizer,
    config,
    crash_in_step,
    reference,
    reference_run,
    state,
    train,
    train_records,
)

import trainforge.engine.trainer as trainer
from trainforge.stop import Interrupted
from trainforge.engine.resume import OutputDirError
from trainforge.metrics.tracker import read_metrics

RESTART = "no checkpoint (stopped before its first one): starting again from step 0"


def test_a_signal_during_the_eval_before_training_then_the_same_command_starts_again(config, tmp_path, monkeypatch):
    """The stop said 'to go on, run the same command with --output runs/t5', and that command exited 2: the eval
    had written its step-0 record to metrics.jsonl, and a directory holding a run without a checkpoint was refused.
    The evaluation now stops at its next batch and writes nothing; the same command trains the run."""
    evaluate = trainer.run_eval

    def signal_while_evaluating(run, label):
        run.stop.signum = signal.SIGTERM
        return evaluate(run, label)

    run = tmp_path / "t5"
    with monkeypatch.context() as m:
        m.setattr(trainer, "run_eval", signal_while_evaluating)
        with pytest.raises(Interrupted, match="to go on, run the same command with --output"):
            train(config, run)
    assert not (run / "metrics.jsonl").is_file() or not read_metrics(run / "metrics.jsonl")

    result, log = train(config, run)
    assert result.summary["steps"] == 6
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 6]  # one eval before training, not two

    from trainforge.tools.doctor import diagnose

    d = diagnose(run)
    assert d["state"] == "finished" and d["last_step"] == 6


def test_a_run_killed_before_its_first_checkpoint_starts_again_and_ends_as_the_uninterrupted_one(
    config, reference, tmp_path, monkeypatch
):
    """SIGKILL (a preemption) before the first checkpoint (every 30 minutes by default) left a directory the same
    command refused forever; it starts again from step 0, and ends bitwise where the uninterrupted run ended."""
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        crash_in_step(m, 2)  # checkpoints every 2 steps: none written yet
        with pytest.raises(Crash):
            train(config, run)
    assert read_metrics(run / "metrics.jsonl") and not list((run / "checkpoints").glob("step-*"))
    _, log = train(config, run)
    assert RESTART in log
    assert train_records(run) == train_records(reference)
    assert_same_weights_and_optimizer(state(run, 6), state(reference, 6))

    with monkeypatch.context() as m:  # twice: the next attempt's files go beside the first's
        crash_in_step(m, 1)
        shutil.rmtree(run)
        with pytest.raises(Crash):
            train(config, run)
    (run / "attempts" / "1").mkdir(parents=True)
    _, log = train(config, run)
    assert RESTART in log and (run / "attempts" / "2" / "metrics.jsonl").is_file()


def test_with_no_checkpoint_another_config_starts_again_too(config, tmp_path, monkeypatch):
    """Nothing was trained, so nothing binds the settings: another learning rate, or other data, is a new start."""
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        crash_in_step(m, 1)
        with pytest.raises(Crash):
            train(config, run)
    config["optim"]["lr"] = 2.0e-3
    _, log = train(config, run)
    assert RESTART in log and "lr: 0.002" in (run / "config.yaml").read_text()


def test_a_finished_run_without_checkpoints_and_a_directory_trainforge_did_not_write_are_still_refused(
    config, reference, tmp_path
):
    shutil.rmtree(reference / "checkpoints")
    metrics = (reference / "metrics.jsonl").read_text()
    with pytest.raises(OutputDirError, match="holds a finished run"):
        train(config, reference)
    assert (reference / "metrics.jsonl").read_text() == metrics and not (reference / "attempts").exists()

    foreign = tmp_path / "foreign"  # another tool's output: a metrics.jsonl, no marker
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    with pytest.raises(OutputDirError, match="no complete checkpoint to resume from"):
        train(config, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["metrics.jsonl"]


def test_resume_cuts_metrics_back_by_step_not_by_line_count(config, reference, tmp_path):
    """Cut by line count (the count saved in the checkpoint), a foreign line before the checkpoint's step kept
    the garbage and dropped a valid record."""
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join([lines[0], "not json at all\n", '{"foreign": true}\n', *lines[1:]]))
    _, log = train(config, run, resume=str(run / "checkpoints" / "step-00000004"))  # records: eval 0, step 4 kept
    assert train_records(run) == train_records(reference)
    assert "dropped 2 lines that are not metrics records" in log


def test_a_run_resumed_at_its_last_step_logs_the_window_its_checkpoint_left_open(config, reference, tmp_path):
    """A stop at step 31 of 40 (log every 50), resumed with max_steps=31: nothing logged step 31's loss, and
    summary.json's final_train_loss was null (or an older step's)."""
    run = tmp_path / "run"
    config["train"]["max_steps"] = 2  # the checkpoint of step 2, between the log steps 0 and 4
    result, _ = train(config, run, resume=str(reference / "checkpoints" / "step-00000002"))
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [2]
    assert steps[0]["loss"] == pytest.approx(result.summary["final_train_loss"])
    assert steps[0]["lr"] > 0 and steps[0]["grad_norm"] > 0
    assert json.loads((run / "summary.json").read_text())["final_train_loss"] is not None


@pytest.mark.parametrize("finished", [False, True])
def test_a_final_eval_after_the_checkpoint_is_kept_only_where_the_run_finished(tmp_path, finished):
    """A run killed while writing final/ resumes at its last checkpoint and evaluates again: the first final eval,
    written after the checkpoint at the same step, was kept too, and the curve held two records of it. Kept where
    the run finished (nothing writes it again)."""
    from trainforge.metrics.tracker import MetricsLog

    path = tmp_path / "metrics.jsonl"
    before = [{"step": 0, "eval_loss": 3.0}, {"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.5}, {"step": 10, "eval_loss": 1.4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*before, {"step": 10, "eval_loss": 1.3}]))
    log = MetricsLog(path)
    later, unreadable = log.keep_through(10, saved_records=len(before), finished=finished)  # 4 records before the save
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == before + ([{"step": 10, "eval_loss": 1.3}] if finished else [])
    assert (later, unreadable) == (0 if finished else 1, 0)


def test_a_signal_during_the_final_evaluation_stops_it_and_the_same_command_finishes(config, tmp_path, monkeypatch):
    """A SIGTERM after the last step's checkpoint was taken as a step's ('finishing the current step') and the final
    evaluation ran to its end, however long: a scheduler's grace period could run out first. It stops between eval
    batches now; the checkpoint holds every step, and the same command evaluates and writes final/."""
    evaluate, finish = trainer.evaluate, trainer.finish
    finishing: list = []  # the run, once its final evaluation is under way
    batches_run: list = []

    def signal_in_final_eval(*args, **kwargs):
        bound = inspect.signature(evaluate).bind(*args, **kwargs)  # run_eval passes eval_stop(run, label) as stop
        stop = bound.arguments.get("stop")
        if finishing and stop is not None:
            finishing[0].stop.signum = signal.SIGTERM

        def counted() -> None:
            batches_run.append(1)
            stop()

        bound.arguments["stop"] = counted if finishing and stop is not None else stop
        return evaluate(*bound.args, **bound.kwargs)

    with monkeypatch.context() as m:
        m.setattr(trainer, "evaluate", signal_in_final_eval)
        m.setattr(trainer, "finish", lambda run: finishing.append(run) or finish(run))
        with pytest.raises(Interrupted, match=r"SIGTERM at step 6: checkpoint step-00000006 saved; to resume"):
            train(config, tmp_path / "run")
    run = tmp_path / "run"
    assert len(batches_run) == 1 and not (run / "final").exists()  # stopped at its first batch
    assert not [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 6 and "eval_loss" in r]
    result, _ = train(config, run)
    assert result.summary["steps"] == 6 and (run / "final").is_dir()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r] == [0, 6]
