"""Resume in-process: crashes at every stage of a save, damaged checkpoints, changed settings,
a longer run, --resume PATH, LoRA, background saves. Exactness is checked bitwise against a
run that was never interrupted."""

from __future__ import annotations

import copy
import errno
import io
import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from rich.console import Console

import trainforge.rundir.atomic as atomic
import trainforge.rundir.checkpoint as ckpt
import trainforge.engine.trainer as trainer
from trainforge.rundir.checkpoint import LATEST, scan_checkpoints
from trainforge.config.run import RunConfig
from trainforge.engine.resume import OutputDirError, ResumeError
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.tracker import read_metrics

from trainforge.metrics.tracker import MEASURED_FIELDS

from conftest import finetune_settings

TIMING = MEASURED_FIELDS


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing in trainforge catches it."""


def reporter() -> tuple[ConsoleReporter, io.StringIO]:
    buf = io.StringIO()
    return ConsoleReporter(Console(file=buf, width=400)), buf


def train(config: dict, out: Path, resume: str = "auto") -> tuple[trainer.RunResult, str]:
    rep, buf = reporter()
    try:
        return trainer.train(RunConfig.model_validate(config), out, rep, resume=resume), buf.getvalue()
    except BaseException:
        print(buf.getvalue())  # shown by pytest when the test fails
        raise


def state(run: Path, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:08d}" / "state.pt")


def assert_same_weights_and_optimizer(got: dict, expected: dict) -> None:
    assert got["model"].keys() == expected["model"].keys()
    for k, v in expected["model"].items():
        assert torch.equal(got["model"][k], v), k
    for pid, ps in expected["optimizer"]["state"].items():
        for k, v in ps.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v), (pid, k)


def train_records(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]


def crash_in_step(monkeypatch, step: int, signum: int | None = None) -> None:
    """Step ``step`` raises ``Crash``, or, given ``signum``, sends this process that signal as it starts."""
    original = trainer.forward_backward_adaptive

    def crashing(run, *args, **kwargs):
        if run.step + 1 == step:
            if signum is None:
                raise Crash(f"crash in step {step}")
            os.kill(os.getpid(), signum)
        return original(run, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward_adaptive", crashing)


def resume_settings(finetune_config: dict) -> dict:
    cfg = copy.deepcopy(finetune_config)
    cfg["train"]["max_steps"] = 6
    cfg["checkpoint"] = {"every_steps": 2, "keep_last": 3}
    # records at steps 4 and 6: resuming from step 2 must carry the half-filled log window over
    cfg["log"] = {"every_steps": 4, "example_indices": True, "report": False}
    return cfg


@pytest.fixture
def config(finetune_config) -> dict:
    return resume_settings(finetune_config)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir, toy_data_dir) -> Path:
    """The uninterrupted run of ``config``, trained once for the module."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    train(resume_settings(finetune_settings(tiny_model_dir, toy_data_dir)), out)
    return out


@pytest.fixture
def reference(reference_run, tmp_path) -> Path:
    """A copy of the uninterrupted run of ``config`` that the test may damage or train into."""
    return Path(shutil.copytree(reference_run, tmp_path / "reference"))


# ---------------------------------------------------------------- a failure at each stage of a save


def _fail_writing_state(monkeypatch, target: str) -> None:
    write = ckpt._write_state

    def partial(tmp, st):
        if tmp.name.startswith(f".{target}.tmp-"):  # its temporary, named after this process
            (tmp / "state.pt").write_bytes(b"PK\x03\x04 half a zip")
            raise Crash("died while writing state.pt")
        write(tmp, st)

    monkeypatch.setattr(ckpt, "_write_state", partial)


def _fail_at(name: str, module=ckpt):
    def inject(monkeypatch, target: str) -> None:
        original = getattr(module, name)

        def failing(*args, **kwargs):
            if target in " ".join(str(a) for a in args):
                raise Crash(f"died in {name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, failing)

    return inject


def _fail_renaming(monkeypatch, target: str) -> None:
    rename = Path.rename

    def failing(self, dest):
        if self.name.startswith(f".{target}.tmp-"):
            raise Crash("died before the rename")
        return rename(self, dest)

    monkeypatch.setattr(Path, "rename", failing)


def _fail_moving_latest(monkeypatch, target: str) -> None:
    move = ckpt._move_latest

    def failing(root, name):
        if name == target:
            raise Crash("died before latest moved")
        move(root, name)

    monkeypatch.setattr(ckpt, "_move_latest", failing)


def _fail_pruning(monkeypatch, target: str) -> None:
    prune = ckpt.prune_checkpoints

    def failing(root, keep):
        if (root / target).exists():
            raise Crash("died while pruning")
        prune(root, keep)

    monkeypatch.setattr(ckpt, "prune_checkpoints", failing)


# (stage, injection, the checkpoint the next start resumes from when step 4's save fails there)
STAGES = [
    ("writing state.pt", _fail_writing_state, 2),
    ("writing meta.json", _fail_at("_write_meta"), 2),
    ("flushing to disk", _fail_at("fsync_tree", atomic), 2),
    ("renaming into place", _fail_renaming, 2),
    ("moving latest", _fail_moving_latest, 4),
    ("pruning", _fail_pruning, 4),
]


@pytest.mark.parametrize(("inject", "resumes_from"), [s[1:] for s in STAGES], ids=[s[0] for s in STAGES])
def test_crash_at_any_stage_of_a_save_resumes_from_a_complete_checkpoint(
    config, reference, tmp_path, monkeypatch, inject, resumes_from
):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        inject(m, "step-00000004")
        with pytest.raises(Crash):
            train(config, run)
    complete, partial = scan_checkpoints(run / "checkpoints")
    assert partial == [] and complete[-1].step == resumes_from  # nothing half-written is visible

    _, log = train(config, run)
    assert f"resuming from {run / 'checkpoints' / f'step-{resumes_from:08d}'}" in log
    assert_same_weights_and_optimizer(state(run, 6), state(reference, 6))
    assert train_records(run) == train_records(reference)
    assert not [p for p in (run / "checkpoints").iterdir() if atomic.TMP_MARK in p.name or atomic.OLD_MARK in p.name]


def test_disk_full_save_is_reported_keeps_earlier_and_is_retried(config, tmp_path, monkeypatch):
    write = ckpt._write_state

    def disk_full(tmp, st):
        if tmp.name.startswith(".step-00000004.tmp-"):
            (tmp / "state.pt").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        write(tmp, st)

    monkeypatch.setattr(ckpt, "_write_state", disk_full)
    result, log = train(config, tmp_path / "run")
    assert "saving checkpoint step-00000004 failed: [Errno 28] No space left on device" in log
    assert "newest complete checkpoint: step-00000002" in log
    assert [c.step for c in scan_checkpoints(tmp_path / "run" / "checkpoints")[0]] == [2, 6]
    assert result.summary["checkpoint_failures"] == 1 and result.summary["checkpoint_saves"] == 2


# ---------------------------------------------------------------- damaged checkpoints


def test_truncated_and_unloadable_checkpoints_are_skipped_with_a_warning(config, reference, tmp_path):
    root = reference / "checkpoints"
    (root / "step-00000006" / "state.pt").write_bytes(b"cut short")
    size = (root / "step-00000004" / "state.pt").stat().st_size
    (root / "step-00000004" / "state.pt").write_bytes(b"\0" * size)  # same size, garbage inside
    (root / "step-00000005").mkdir()  # a directory that never got its meta.json
    config["train"]["max_steps"] = 6
    result, log = train(config, reference)
    assert f"skipping checkpoint {root / 'step-00000006'}: state.pt is truncated" in log
    assert f"skipping checkpoint {root / 'step-00000005'}: no meta.json" in log
    assert f"skipping checkpoint {root / 'step-00000004'}: state.pt is damaged" in log  # its checksum
    assert f"resuming from {root / 'step-00000002'}" in log
    assert result.summary["resumed_from_step"] == 2 and result.summary["steps"] == 6


def flip_inside_largest_tensor(path: Path, n: int = 4096) -> None:
    """XOR ``n`` bytes inside the largest tensor's record of a state.pt in place: the size and the zip
    structure unchanged, so ``torch.load`` still reads it (the damage the checksum is there for)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    for i in range(start, start + min(n, info.file_size)):
        data[i] ^= 0xA5
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


def rewrite_state(path: Path, st: dict) -> None:
    """Save ``st`` as the checkpoint's state.pt with a correct checksum in its meta.json."""
    record = ckpt._write_state(path, st)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"].update(record)
    (path / "meta.json").write_text(json.dumps(meta))


def all_finite(st: dict) -> bool:
    from trainforge.engine.nonfinite import checkpoint_tensors, nonfinite_tensors

    return not nonfinite_tensors(checkpoint_tensors(st))


def test_checkpoint_with_flipped_bytes_is_skipped_for_the_previous_one(config, reference, reference_run):
    root = reference / "checkpoints"
    flip_inside_largest_tensor(root / "step-00000006" / "state.pt")
    torch.load(root / "step-00000006" / "state.pt", weights_only=True)  # loads fine: only the checksum tells
    config["train"]["max_steps"] = 6
    result, log = train(config, reference)
    assert f"skipping checkpoint {root / 'step-00000006'}: state.pt is damaged: its crc32 is" in log
    assert f"resuming from {root / 'step-00000004'}" in log
    assert result.summary["resumed_from_step"] == 4 and "nonfinite_weights" not in result.summary
    assert all_finite(state(reference, 6))
    assert_same_weights_and_optimizer(state(reference, 6), state(reference_run, 6))  # replayed exactly


def test_checkpoint_with_nan_in_optimizer_state_is_skipped(config, reference, reference_run):
    root = reference / "checkpoints"
    st = state(reference, 6)
    st["optimizer"]["state"][0]["exp_avg"].view(-1)[7] = float("nan")
    rewrite_state(root / "step-00000006", st)  # the checksum matches: the second line catches it
    assert ckpt.verify_checkpoint(ckpt.inspect_checkpoint(root / "step-00000006")) is None
    result, log = train(config, reference)
    assert (
        f"skipping checkpoint {root / 'step-00000006'}: its weights or optimizer state are not finite: "
        "1 non-finite values in 1 tensor (optimizer state exp_avg of parameter 0: 1)"
    ) in log
    assert f"resuming from {root / 'step-00000004'}" in log
    assert_same_weights_and_optimizer(state(reference, 6), state(reference_run, 6))


def test_nan_weights_in_the_only_checkpoint_named_in_resume_error(config, reference, tmp_path):
    target = reference / "checkpoints" / "step-00000004"
    st = state(reference, 4)
    next(iter(st["model"].values())).view(-1)[0] = float("inf")
    rewrite_state(target, st)
    with pytest.raises(ResumeError, match=f"no checkpoint could be loaded: {target} \\(its weights or optimizer state"):
        train(config, tmp_path / "new", resume=str(target))


def test_checkpoints_without_checksums_still_resume(config, reference, reference_run):
    root = reference / "checkpoints"
    for c in scan_checkpoints(root)[0]:  # the meta.json format before checksums: sizes only
        meta = json.loads((c.path / "meta.json").read_text())
        meta["files"] = {name: rec["bytes"] for name, rec in meta["files"].items()}
        (c.path / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(root / "step-00000006")
    _, log = train(config, reference)
    assert f"checkpoint {root / 'step-00000004'} records no checksums" in log
    assert f"resuming from {root / 'step-00000004'}" in log
    assert_same_weights_and_optimizer(state(reference, 6), state(reference_run, 6))
    assert "crc32" in json.loads((root / "step-00000006" / "meta.json").read_text())["files"]["state.pt"]


def test_non_finite_final_weights_are_reported(config, tmp_path):
    rep, buf = reporter()
    with trainer.open_run(RunConfig.model_validate(config), tmp_path / "run", rep) as run:
        trainer.train_loop(run, 2)
        with torch.no_grad():
            next(p for p in run.model.parameters() if p.requires_grad).view(-1)[:5] = float("nan")
        result = trainer.finish(run)
    assert "THE TRAINED WEIGHTS ARE NOT FINITE: 5 non-finite values in 1 tensor" in buf.getvalue()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["nonfinite_weights"] is True and result.summary["nonfinite_weights"] is True
    assert list(summary["nonfinite_tensors"].values()) == [5]


# ---------------------------------------------------------------- what a resume refuses and allows


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("train.grad_accum", 4, "train.grad_accum: 2 in the checkpoint, 4 now"),
        ("optim.lr", 5e-4, "optim.lr: 0.001 in the checkpoint, 0.0005 now"),
        ("model.method", "lora", "model.method: 'full' in the checkpoint, 'lora' now"),
    ],
)
def test_changed_setting_is_refused_naming_it_and_touching_nothing(config, reference, key, value, named):
    before = {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()}
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ResumeError, match=named.replace("(", r"\(")):
        train(config, reference)
    assert {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()} == before


def test_a_changed_setting_is_refused_before_the_data_is_tokenized(config, reference, tmp_path, monkeypatch):
    """A rerun with a changed data setting (data.max_length) tokenized the whole corpus again, into a new cache
    entry, and loaded the model before the checkpoint refused it: minutes to hours on a real corpus. The
    refusal now comes first: no tokenizing, no model."""
    import trainforge.rl.wiring as wiring  # set-up takes plan_data from there (data_planner: grpo plans prompts)

    def no_work(*args, **kwargs):
        raise AssertionError("the data was prepared before the changed setting was refused")

    monkeypatch.setattr(wiring, "plan_data", no_work)
    config["data"]["max_length"] = 48
    with pytest.raises(ResumeError, match="data.max_length: 64 in the checkpoint, 48 now"):
        train(config, reference)


@pytest.mark.parametrize("batch", [{"micro_batch_size": "auto"}, {"global_batch_size": 8}])
def test_a_batch_the_run_resolves_itself_resumes_with_the_same_command(config, tmp_path, batch):
    """A checkpoint binds the resolved micro-batch and accumulation; the rerun's config still said ``auto`` (or
    left grad_accum to global_batch_size), so the same command was refused ("train.micro_batch_size: 8 in the
    checkpoint, 'auto' now"; "train.grad_accum: 2 in the checkpoint, 1 now"): such a run could never resume."""
    del config["train"]["grad_accum"]
    config["train"].update(batch, max_steps=4)
    first = train(config, tmp_path / "run")[0]
    config["train"]["max_steps"] = 6
    result, log = train(config, tmp_path / "run")
    assert "resuming from" in log and "step-00000004" in log and result.summary["steps"] == 6
    assert result.summary["micro_batch_size"] == first.summary["micro_batch_size"]
    assert result.summary["grad_accum"] == first.summary["grad_accum"]
    if "global_batch_size" in batch:  # the global batch the config fixes still binds the checkpoint
        config["train"].update(global_batch_size=16, max_steps=8)
        with pytest.raises(ResumeError, match=r"train.grad_accum: 2 in the checkpoint, 4 now \(derived from "
                           r"train.global_batch_size: 16;"):  # the setting the user changed is named
            train(config, tmp_path / "run")


def test_changed_data_at_the_same_path_is_refused(config, tmp_path):
    data = tmp_path / "train.jsonl"
    rows = Path(config["data"]["train"]).read_text().splitlines()
    data.write_text("\n".join(rows) + "\n")
    config["data"]["train"] = str(data)
    config["train"]["max_steps"] = 2
    train(config, tmp_path / "run")
    data.write_text("\n".join(rows[:-40]) + "\n")
    with pytest.raises(ResumeError, match="training data differ"):
        train(config, tmp_path / "run")


def test_longer_max_steps_continues_on_the_original_schedule(config, tmp_path):
    config["log"]["every_steps"] = 1
    reference = tmp_path / "run"
    train(config, reference)
    config["train"]["max_steps"] = 9
    result, log = train(config, reference)
    assert "keeps its 6-step horizon" in log and "records written after" not in log
    evals = [r["step"] for r in read_metrics(reference / "metrics.jsonl") if "eval_loss" in r]
    assert evals == [0, 6, 9]  # the first run's final evaluation stays in the curve
    # where this process's wall time went: not the first process's loop and eval seconds too (they once made
    # "start-up 80%" and "81% of it training steps" of one wall time)
    earlier, t = state(reference, 6)["counters"], result.summary["time"]
    loop_here = result.summary["train_time_s"] - earlier["loop_time_s"]
    assert t["train_s"] + t["data_wait_s"] + t["compile_s"] == pytest.approx(loop_here, abs=1e-3)
    assert 0 < t["eval_s"] < result.summary["time"]["wall_s"] and t["data_wait_s"] < loop_here
    parts = sum(v for k, v in t.items() if k.endswith("_s") and k != "wall_s")
    assert parts <= t["wall_s"] + 0.01
    lrs = {r["step"]: r["lr"] for r in read_metrics(reference / "metrics.jsonl") if "lr" in r}
    assert sorted(lrs) == list(range(1, 10))
    floor = config["optim"]["lr"] * 0.1  # min_lr_ratio
    assert lrs[7] == lrs[8] == lrs[9] == pytest.approx(floor)
    assert result.summary["steps"] == 9
    config["train"]["max_steps"] = 5
    with pytest.raises(ResumeError, match="train.max_steps=5 is below"):
        train(config, reference)


def test_an_epochs_run_trains_on_with_more_epochs(config, tmp_path):
    """A finished epochs run said "To train on, raise train.max_steps", which the config then refused beside
    epochs, and train.epochs was bound to the checkpoint: such a run could not be trained on at all."""
    del config["train"]["max_steps"]
    config["train"]["epochs"] = 1
    run = tmp_path / "run"
    first = train(config, run)[0].summary["steps"]
    _, log = train(config, run)
    assert "nothing to train. To train on, raise train.epochs;" in log
    config["train"]["epochs"] = 2
    result, log = train(config, run)
    steps = result.summary["steps"]
    assert 2 * first - 1 <= steps <= 2 * first and f"(step {first} of {steps})" in log
    config["train"]["epochs"] = 1
    with pytest.raises(ResumeError, match=rf"train.epochs=1 \({first} steps\) is below the step of .* give train.max_steps"):
        train(config, run)


def test_the_same_command_on_a_finished_run_trains_and_rewrites_nothing(config, reference):
    """A rerun after the run ended says so and leaves final/, summary.json and the metrics as they were
    (it once re-evaluated, rewrote final/ and printed 'done: 6 steps' for steps it never ran)."""
    before = {p: p.stat().st_mtime_ns for p in (reference / "summary.json", reference / "final" / "model.safetensors")}
    metrics = (reference / "metrics.jsonl").read_text()
    result, log = train(config, reference)
    assert "holds this run finished: 6 steps" in log and "raise train.max_steps" in log and "done:" not in log
    assert result.summary["steps"] == 6 and {p: p.stat().st_mtime_ns for p in before} == before
    # the final evaluation, written after the last checkpoint, was once cut off as if a crash had left it
    assert "records written after" not in log and (reference / "metrics.jsonl").read_text() == metrics


def test_the_end_line_of_a_resumed_run_says_its_wall_time_is_this_process_alone(config, reference, tmp_path):
    """The steps, tokens and training seconds of the end line count the whole run, the wall time only this process:
    after a resume it read 'done: 3000 steps, 682,196 tokens in 24.0s (...), wall time 14.8s', training longer than
    the wall; it names the step this process resumed at."""
    run = Path(shutil.copytree(reference, tmp_path / "run"))
    _, log = train(config, tmp_path / "fresh")
    assert re.search(r"done: 6 steps, [\d,]+ tokens in [\d.]+s \([\d,]+ tok/s\), wall time [\d.]+s", log)
    _, log = train(config, run, resume=str(run / "checkpoints" / "step-00000002"))
    assert re.search(r"done: 6 steps, [\d,]+ tokens in [\d.]+s \([\d,]+ tok/s\); this process resumed it at step 2: "
                     r"wall time [\d.]+s", log)


def test_resume_never_refuses_a_directory_holding_a_run(config, reference):
    with pytest.raises(OutputDirError, match="already holds a run"):
        train(config, reference, resume="never")


def test_resume_path_to_an_older_checkpoint_cuts_metrics_back_and_replays_exactly(config, reference, tmp_path):
    run = Path(shutil.copytree(reference, tmp_path / "run"))  # a finished run, as train(config, run) leaves it
    _, log = train(config, run, resume=str(run / "checkpoints" / "step-00000002"))
    assert "dropped" in log and "records written after step-00000002" in log
    assert train_records(run) == train_records(reference)
    assert_same_weights_and_optimizer(state(run, 6), state(reference, 6))

    elsewhere = tmp_path / "forked"  # a checkpoint of another run directory starts a new metrics log
    train(config, elsewhere, resume=str(run))
    assert read_metrics(elsewhere / "metrics.jsonl")[0]["step"] == 6


def test_unwritable_output_dir_fails_at_start(config, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputDirError, match=r"--output .*a-file/run is below .*a-file, which is a file, not a directory"):
        train(config, blocker / "run")
    with pytest.raises(OutputDirError, match=r"--output .*a-file is a file, not a directory: give a new or empty directory"):
        train(config, blocker)  # it said "cannot write to output directory a-file: File exists"


# ---------------------------------------------------------------- LoRA and background saves


def test_lora_checkpoint_holds_the_adapter_and_resumes_exactly(config, tmp_path, monkeypatch):
    config["model"]["method"] = "lora"
    config["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.2}  # dropout: the RNG state must resume too
    train(config, tmp_path / "reference")
    saved = state(tmp_path / "reference", 6)["model"]
    assert saved and all("lora_" in k for k in saved)

    with monkeypatch.context() as m:
        crash_in_step(m, 5)
        with pytest.raises(Crash):
            train(config, tmp_path / "run")
    train(config, tmp_path / "run")
    assert_same_weights_and_optimizer(state(tmp_path / "run", 6), state(tmp_path / "reference", 6))


def test_background_saves_write_the_same_checkpoints(config, reference, tmp_path):
    config["checkpoint"]["async"] = True
    result, log = train(config, tmp_path / "async")
    assert log.count("written in the background") == 3, log
    assert result.summary["checkpoint_saves"] == 3
    for step in (2, 4, 6):
        got, expected = state(tmp_path / "async", step), state(reference, step)
        assert_same_weights_and_optimizer(got, expected)
        assert got["loader"] == expected["loader"] and got["counters"]["step"] == step
    assert (tmp_path / "async" / "checkpoints" / LATEST).read_text().strip() == "step-00000006"
    meta = json.loads((tmp_path / "async" / "checkpoints" / "step-00000006" / "meta.json").read_text())
    assert meta["fixed"]["train.grad_accum"] == 2 and len(meta["config_hash"]) == 16


def test_doctor_on_a_run_killed_after_resuming_before_its_first_log_step(config, reference):
    """Stopped at step 6, resumed, then SIGKILLed before logging: doctor said 'at step 0' and '-6 logged steps
    are trained again'. It stands at its checkpoint, killed (not stopped by the signal it resumed from)."""
    import json

    from trainforge.tools.doctor import diagnose, render

    (reference / "summary.json").unlink()
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    (reference / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if "loss" not in r))
    with open(reference / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": "stop", "step": 6, "signal": "SIGINT"}) + "\n")
        f.write(json.dumps({"event": "start", "step": 6, "max_steps": 6}) + "\n")
    d = diagnose(reference)
    assert d["last_step"] == 6 and d["state"].startswith("ended without a summary")
    assert "-" not in render(d).split("logged steps")[0].rsplit("(", 1)[-1]  # no negative count of lost steps


def test_another_process_count_is_refused_with_the_fix_that_applies():
    """Without train.global_batch_size: the checkpoint's global batch to set in place of grad_accum. An FSDP checkpoint:
    its processes. A DDP checkpoint resumed under FSDP on other processes: train.distributed: ddp (it blamed the
    checkpoint's shards, which it has none of)."""
    from pathlib import Path

    from trainforge.rundir.checkpoint import CheckpointInfo
    from trainforge.config.run import load_config
    from trainforge.engine.resume import ResumeError, check_world

    def info(world: int, mode: str) -> CheckpointInfo:
        meta = {"world_size": world, "distributed": mode, "fixed": {"train.micro_batch_size": 2, "train.grad_accum": 2}}
        return CheckpointInfo(Path("run/checkpoints/step-00000003"), 3, meta)

    plain = load_config(None, ["train.micro_batch_size=2", "train.grad_accum=2"])
    with pytest.raises(ResumeError, match=r"set train.global_batch_size: 8 \(the checkpoint's global batch\) in place of "
                                          r"train.grad_accum to keep it on 1"):
        check_world(info(2, "ddp"), 1, plain)
    # 2 rows x 8 processes cannot make 8 rows: the advice names the counts that can, not one that is refused next
    with pytest.raises(ResumeError, match=r"set train.global_batch_size: 8 in place of train.grad_accum to resume on 1, 2, 4 "
                                          r"processes \(where 2 rows x processes divide it\)"):
        check_world(info(2, "ddp"), 8, plain)
    held = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=8"])
    check_world(info(2, "ddp"), 1, held)  # the global batch holds: allowed
    with pytest.raises(ResumeError, match="FSDP's sharded state resumes on the processes that wrote it"):
        check_world(info(2, "fsdp"), 1, held)
    fsdp = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=8", "train.distributed=fsdp"])
    with pytest.raises(ResumeError, match=r"\(one process's state\) on 2 processes sharded with FSDP: set train.distributed: ddp"):
        check_world(info(1, "none"), 2, fsdp)


def test_other_base_weights_at_the_same_model_path_are_refused_and_a_moved_base_is_not(tmp_path, tiny_model_dir):
    """Only the model.path string was compared: a LoRA run resumed on another model copied to the same path went on
    without a word, and the same directory written another way (relative, absolute) was refused. The checkpoint
    keeps a fingerprint of the base's weights; the weights decide."""
    import shutil

    from trainforge.rundir.checkpoint import CheckpointInfo
    from trainforge.config.run import load_config
    from trainforge.engine.resume import ResumeError, check_settings, checkpoint_meta
    from trainforge.model.tokenizer import build_char_tokenizer
    from trainforge.model.weight_files import weights_fingerprint

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    cfg = load_config(None, [f"model.path={base}", "model.method=lora", f"model.tokenizer={tiny_model_dir}"])
    meta = checkpoint_meta(cfg, build_char_tokenizer(["ab"]), {})
    assert meta["model_weights"] == weights_fingerprint(base)
    info = CheckpointInfo(tmp_path / "run" / "checkpoints" / "step-00000003", 3, meta)
    check_settings(info, cfg)  # the same
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    check_settings(info, cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": moved})}))  # same weights
    from safetensors.torch import load_file, save_file

    tuned = {k: v + 1e-3 for k, v in load_file(base / "model.safetensors").items()}  # another fine-tune of the same shapes
    save_file(tuned, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ResumeError, match=r"the weights at model.path .*base are not those the checkpoint trained from"):
        check_settings(info, cfg)
    older = CheckpointInfo(info.path, 3, {k: v for k, v in meta.items() if k != "model_weights"})
    check_settings(older, cfg)  # a checkpoint without the fingerprint compares the path, as before
