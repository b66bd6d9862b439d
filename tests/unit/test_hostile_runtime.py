"""Hostile and broken inputs through the public lifecycle: a run that can never fit is refused before the
model is built (exit 4); a non-finite stop says where the last good weights are, or that there are none;
a full disk while the run writes its directory is a ``RunDirWriteError`` (exit 2) naming the path."""

from __future__ import annotations

import copy
import errno
import io
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console

from test_faults import poison_steps

import trainforge.engine.row_length as row_length
import trainforge.engine.setup as engine_setup
import trainforge.engine.trainer as trainer
import trainforge.metrics.tracker as tracker
from trainforge.config.run import RunConfig
from trainforge.engine.nonfinite import NonFiniteError
from trainforge.engine.oom import OutOfMemory
from trainforge.engine.predict.memory import GIB, MemoryEstimate, memory_refusal, memory_warning
from trainforge.errors import EXIT_BAD_INPUT, EXIT_OUT_OF_MEMORY
from trainforge.metrics.console import ConsoleReporter
from trainforge.rundir.writing import RunDirWriteError, io_error, writing


def train(config: dict, out: Path):
    buf = io.StringIO()
    try:
        return trainer.train(RunConfig.model_validate(config), out, ConsoleReporter(Console(file=buf, width=400)))
    finally:
        train.log = buf.getvalue()


@pytest.fixture
def config(finetune_config) -> dict:
    cfg = copy.deepcopy(finetune_config)
    cfg["train"]["max_steps"] = 4
    cfg["checkpoint"] = {"every_steps": 2}
    cfg["log"] = {"every_steps": 1, "report": False}
    return cfg


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ---------------------------------------------------------------- a run that can never fit


def test_refusal_is_for_more_than_twice_the_device_and_the_warning_stays_below():
    est = MemoryEstimate(weights=4 * GIB, grads=4 * GIB, optimizer=8 * GIB, activations=4 * GIB)  # 20 GiB
    assert memory_refusal(est, 10 * GIB, "the GPU", "at micro-batch 1", ["lower data.max_length (512)"]) is None  # 2x: starts
    assert memory_warning(est, 10 * GIB, torch.device("cuda")) is not None  # ... with the warning
    message = memory_refusal(est, 9 * GIB, "the GPU (H100)", "at micro-batch 1", ["lower data.max_length (512)"])
    assert message.startswith("this run cannot fit: estimated memory 20.00 GiB (weights 4.00, grads 4.00, optimizer 8.00")
    assert "at micro-batch 1 is 2.2x the 9.0 GiB of the GPU (H100)" in message
    assert "refused before loading the model" in message and "To fit: lower data.max_length (512)" in message
    assert "trainforge plan CONFIG" in message
    assert memory_refusal(est, None, "system memory", "", []) is None  # the system does not say: no refusal


def test_a_run_that_can_never_fit_is_refused_before_the_model_is_built(config, tmp_path, monkeypatch):
    monkeypatch.setattr(row_length, "device_memory", lambda device: (64 * 1024, "system memory available to this process"))
    monkeypatch.setattr(engine_setup, "build_run_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(OutOfMemory) as e:
        train(config, tmp_path / "run")
    message = str(e.value)
    assert e.value.exit_code == EXIT_OUT_OF_MEMORY
    # a CPU has no out-of-memory back-off: the configured micro-batch is what the run needs
    assert "this run cannot fit" in message and "at micro-batch 4 with activation checkpointing" in message
    assert "0.0 GiB of system memory available to this process" in message
    assert "lower train.micro_batch_size" in message and "use model.method: lora or qlora" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_run_within_twice_the_memory_starts_with_the_warning(config, tmp_path, monkeypatch):
    seen = []

    def at_one_and_a_half(est, capacity, *args):  # the device has 1/1.5 of what the run is estimated to need
        seen.append(memory_refusal(est, int(est.total / 1.5), *args))
        return seen[-1]

    monkeypatch.setattr(row_length, "memory_refusal", at_one_and_a_half)
    monkeypatch.setattr(engine_setup, "available_memory_bytes", lambda device: 1024)
    config["train"]["max_steps"] = 1
    train(config, tmp_path / "run")
    assert seen == [None] and "warning: this run may not fit" in train.log


# ---------------------------------------------------------------- non-finite: where the last good weights are


def poison_from(monkeypatch, first: int) -> None:
    """The loss is NaN from step ``first`` on, as optim.lr: .inf makes it."""
    poison_steps(monkeypatch, range(first, 10**9))


def test_a_nonfinite_stop_without_a_checkpoint_says_there_is_none(config, tmp_path, monkeypatch):
    config["checkpoint"] = {"every_steps": None}
    poison_from(monkeypatch, 1)
    with pytest.raises(NonFiniteError) as e:
        train(config, tmp_path / "run")
    assert "no checkpoint was saved before the stop" in str(e.value)
    assert "holds the last good weights" not in str(e.value)


def test_a_nonfinite_stop_names_the_newest_checkpoint(config, tmp_path, monkeypatch):
    config["train"]["max_steps"] = 8
    poison_from(monkeypatch, 3)  # steps 3, 4, 5 skipped; step 4's checkpoint holds step 2's weights
    with pytest.raises(NonFiniteError) as e:
        train(config, tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step-00000004"
    assert f"the newest checkpoint, {newest}, holds the last good weights" in str(e.value)


# ---------------------------------------------------------------- a full disk while the run writes its directory


def test_writing_turns_os_errors_and_their_library_texts_into_one_paragraph(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(RunDirWriteError) as e, writing(run / "metrics.jsonl"):
        raise no_space(run / "metrics.jsonl")
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert str(e.value).startswith(f"cannot write {run / 'metrics.jsonl'}: No space left on device; the disk that holds")
    assert "Free space on that disk" in str(e.value) and "starts again from step 0" in str(e.value)
    # safetensors says it in its own words
    found = io_error(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert found.errno == errno.ENOSPC
    with pytest.raises(ValueError), writing(run / "final"):  # anything else is not the disk's
        raise ValueError("a bug")


def test_disk_full_while_recording_a_failed_checkpoint_stops_with_exit_2(config, tmp_path, monkeypatch):
    """The issue's case: the checkpoint fails on a full disk, then so does its line in events.jsonl."""
    run = tmp_path / "run"
    tried = []  # the disk fills when the checkpoint is written: events before it (the start, evals) were recorded

    def full_save(*a, **k):
        tried.append(True)
        raise no_space("state.pt")

    monkeypatch.setattr(torch, "save", full_save)

    def full_open(file, mode="r", *args, **kwargs):
        if Path(file).name == "events.jsonl" and tried:
            raise no_space(file)
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(tracker, "open", full_open, raising=False)
    with pytest.raises(RunDirWriteError) as e:
        train(config, run)
    assert str(e.value).startswith(f"cannot write {run / 'events.jsonl'}: No space left on device")
    assert "saving checkpoint step-00000002 failed" in train.log and "MiB free on its disk" in train.log


def test_disk_full_in_metrics_jsonl_stops_with_exit_2(config, tmp_path, monkeypatch):
    run = tmp_path / "run"

    class FullAfter:
        def __init__(self, f, lines: int):
            self.f, self.lines = f, lines

        def write(self, text):
            self.lines -= 1
            if self.lines < 0:
                raise no_space(run / "metrics.jsonl")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def full_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        return FullAfter(f, 3) if Path(file).name == "metrics.jsonl" else f

    monkeypatch.setattr(tracker, "open", full_open, raising=False)
    with pytest.raises(RunDirWriteError, match=r"cannot write .*metrics\.jsonl: No space left on device"):
        train(config, run)


@pytest.mark.parametrize("target", ["final", "summary.json"])
def test_disk_full_at_the_end_stops_with_exit_2_and_names_what_resumes(config, tmp_path, monkeypatch, target):
    run = tmp_path / "run"
    if target == "final":  # safetensors' own error, from save_pretrained
        def full(*args, **kwargs):
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(trainer, "atomic_write_dir", full)
    else:
        write_text = Path.write_text
        monkeypatch.setattr(
            Path, "write_text",
            lambda self, *a, **k: (_ for _ in ()).throw(no_space(self)) if self.name == target else write_text(self, *a, **k),
        )
    with pytest.raises(RunDirWriteError) as e:
        train(config, run)
    message = str(e.value)
    assert message.startswith(f"cannot write {run / target}: No space left on device")
    # the last step's checkpoint is on disk: the same command resumes from it and writes the end again
    assert f"resumes from the newest complete checkpoint, {run / 'checkpoints' / 'step-00000004'}" in message


def test_report_to_a_full_disk_is_a_report_error(tmp_path, monkeypatch):
    import trainforge.metrics.report as report
    from trainforge.metrics.report_data import ReportError

    monkeypatch.setattr(report, "load_run", lambda p: type("R", (), {"name": "r", "path": p, "unreadable": []})())
    monkeypatch.setattr(report, "render_html", lambda runs: "<html></html>")
    monkeypatch.setattr(report, "atomic_write_text", lambda path, text: (_ for _ in ()).throw(no_space(path)))
    with pytest.raises(ReportError, match=r"cannot write .*page\.html: No space left on device; free space there, or write it "
                                          r"elsewhere with --out FILE"):
        report.write_report([tmp_path], tmp_path / "page.html")
    # another refusal is not a full disk: no advice to free space
    monkeypatch.setattr(report, "atomic_write_text", lambda path, text: (_ for _ in ()).throw(IsADirectoryError(21, "Is a directory")))
    with pytest.raises(ReportError, match=r"cannot write .*page\.html: Is a directory; write it elsewhere with --out FILE"):
        report.write_report([tmp_path], tmp_path / "page.html")
