"""Kill it, signal it, resume it: the interrupted run ends bitwise equal to the one that was not.

One run is interrupted four ways in a row, each in its own ``trainforge train`` process:
SIGKILL inside a step, SIGKILL while a checkpoint is being written, SIGTERM followed by a
second SIGTERM during the save it triggers, and a plain SIGTERM. Every restart uses the
default ``--resume auto``. The model uses attention dropout, so every step draws random
numbers and the random states have to resume exactly too.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from integration_helpers import root_conftest, run_cli, show

from trainforge.rundir.checkpoint import scan_checkpoints
from trainforge.config.run import RunConfig

write_config = root_conftest().write_config
from trainforge.metrics.tracker import MEASURED_FIELDS

TIMING = MEASURED_FIELDS  # wall-clock and machine fields: the only ones allowed to differ


@pytest.fixture
def scratch_config(tiny_tokenizer_dir, toy_data_dir) -> dict:
    return {
        "model": {
            "init": {**root_conftest().TINY_LLAMA_INIT, "attention_dropout": 0.1},
            "tokenizer": str(tiny_tokenizer_dir),
        },
        "data": {"train": str(toy_data_dir / "pc_train.jsonl"), "eval": str(toy_data_dir / "pc_eval.jsonl"), "max_length": 64},
        "train": {
            "max_steps": 10,
            "micro_batch_size": 4,
            "grad_accum": 2,
            "precision": "fp32",
            "device": "cpu",
            "eval_every": 4,
            "eval_max_batches": 2,
        },
        "optim": {"lr": 1.0e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "log": {"every_steps": 1, "example_indices": True, "report": False},
    }


def records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def visible_steps(run: Path) -> list[int]:
    complete, partial = scan_checkpoints(run / "checkpoints")
    assert partial == [], f"a partial checkpoint is visible: {partial}"
    return [c.step for c in complete]


def assert_same_state(got: dict, expected: dict) -> None:
    """Model weights, optimizer state and everything else in state.pt: bitwise equal."""
    assert got["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), f"weight {name} differs"
    for pid, pstate in expected["optimizer"]["state"].items():
        for key, value in pstate.items():
            assert torch.equal(got["optimizer"]["state"][pid][key], value), f"optimizer state {pid}.{key} differs"
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert got["scheduler"] == expected["scheduler"]
    assert got["loader"] == expected["loader"]
    assert torch.equal(got["rng"]["torch"], expected["rng"]["torch"])


def test_killed_and_signalled_run_resumes_bitwise_exact(tmp_path, scratch_config):
    from rich.console import Console

    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    reference = tmp_path / "reference"
    train(RunConfig.model_validate(scratch_config), reference, ConsoleReporter(Console(quiet=True)))

    config = write_config(tmp_path / "scratch.yaml", scratch_config)
    run = tmp_path / "run"
    cli = lambda faults: run_cli(["train", config, "--output", run], tmp_path, faults=faults)

    # 1. SIGKILL inside step 5: step-3 is the newest checkpoint; metrics went on to step 4
    proc = cli({"signal_in_step": [5, "SIGKILL"]})
    assert proc.returncode == -signal.SIGKILL, show(proc)
    assert visible_steps(run) == [3]

    # 2. resumes from 3; SIGKILL after state.pt of step 6 is written, before its meta.json: invisible
    proc = cli({"signal_in_save": [6, "SIGKILL"]})
    assert proc.returncode == -signal.SIGKILL, show(proc)
    assert "resuming from" in proc.stdout and "step-00000003" in proc.stdout, show(proc)
    assert visible_steps(run) == [3]

    # 3. resumes from 3 again; SIGTERM in step 7, and a second SIGTERM during the save it asks for
    proc = cli({"signal_in_step": [7, "SIGTERM"], "signal_in_save": [7, "SIGTERM"]})
    assert proc.returncode == -signal.SIGTERM, show(proc)
    assert "finishing the current step" in proc.stderr, show(proc)
    assert visible_steps(run) == [3, 6]

    # 4. resumes from 6; SIGTERM in step 8: the step finishes, step-8 is saved, exit code 75
    proc = cli({"signal_in_step": [8, "SIGTERM"]})
    assert proc.returncode == 75, show(proc)
    assert "step-00000006" in proc.stdout and "checkpoint step-00000008 saved" in proc.stderr, show(proc)
    assert f"run the same command with --output {run}" in proc.stderr, show(proc)  # names where to resume
    assert visible_steps(run) == [6, 8]

    # 5. resumes from 8 and finishes
    proc = cli({})
    assert proc.returncode == 0, show(proc)
    assert visible_steps(run) == [9, 10]

    expected = torch.load(reference / "checkpoints" / "step-00000010" / "state.pt")
    got = torch.load(run / "checkpoints" / "step-00000010" / "state.pt")
    assert_same_state(got, expected)
    # metrics.jsonl: every step once, in order, with the same losses, evals and trained example indices
    assert records(run) == records(reference)
    train_steps = [r["step"] for r in records(run) if "loss" in r]
    assert train_steps == list(range(1, 11))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8 and summary["steps"] == 10


def test_nan_streak_exits_3_and_changed_setting_exits_2(tmp_path, finetune_config):
    finetune_config["train"].update(max_steps=6, max_skipped_steps=2)
    finetune_config["checkpoint"] = {"every_steps": 2}
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "run"

    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"nan_in_steps": [3, 4]})
    assert proc.returncode == 3, show(proc)
    assert "stopped at step 4" in proc.stderr and "Example indices of those batches: step 3: [" in proc.stderr, show(proc)
    # ... and their documents, by source file and first words, which can be searched for in the data
    assert 'Their documents (source, first words): row ' in proc.stderr and 'pc_train.jsonl "' in proc.stderr, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    assert [c.step for c in scan_checkpoints(run / "checkpoints")[0]] == [2]
    # doctor says why it ended (the run used to look killed: an error left no trace in events.jsonl)
    doctor = run_cli(["doctor", run, "--json"], tmp_path)
    assert doctor.returncode == 0, show(doctor)
    assert json.loads(doctor.stdout)["state"].startswith("failed at step 4 (exit code 3): NonFiniteError: training stopped"), show(doctor)

    proc = run_cli(["train", config, "--output", run, "--set", "train.micro_batch_size=2"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "train.micro_batch_size: 4 in the checkpoint, 2 now" in proc.stderr, show(proc)


def test_checkpoint_damaged_in_place_is_skipped_by_the_cli(tmp_path, finetune_config):
    """4,096 bytes of the newest state.pt flipped, its size unchanged: the next start names the damage,
    resumes from the previous checkpoint and writes finite weights to final/."""
    import struct
    import zipfile

    from safetensors.torch import load_file

    finetune_config["train"]["max_steps"] = 4
    finetune_config["checkpoint"] = {"every_steps": 2, "keep_last": 3}
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert visible_steps(run) == [2, 4]

    state = run / "checkpoints" / "step-00000004" / "state.pt"
    with zipfile.ZipFile(state) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)  # the largest tensor's bytes
    data = bytearray(state.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start : start + 4096] = bytes(b ^ 0xFF for b in data[start : start + 4096])
    state.write_bytes(bytes(data))

    proc = run_cli(["train", config, "--output", run, "--set", "train.max_steps=6"], tmp_path)
    assert proc.returncode == 0, show(proc)
    out = proc.stdout + proc.stderr
    assert "step-00000004: state.pt is damaged" in out and "resuming from" in out, show(proc)
    assert "step-00000002 (step 2 of 6)" in out, show(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 6 and "nonfinite_weights" not in summary
    weights = load_file(run / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_signal_during_an_evaluation_between_steps_stops_it_and_the_same_command_evaluates_and_goes_on(
    tmp_path, finetune_config
):
    """SIGTERM during the evaluation of train.eval_every ran all of it first (10,000 batches: 167 s after the
    signal, past a scheduler's grace period). It stops at its next batch now: the step's checkpoint is saved,
    exit 75, nothing of the evaluation is logged; the same command evaluates at that step and trains on, and its
    metrics.jsonl is the uninterrupted run's."""
    finetune_config["train"].update(max_steps=6, micro_batch_size=2, grad_accum=1, eval_every=2, eval_max_batches=None)
    finetune_config["log"]["every_steps"] = 1
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert run_cli(["train", config, "--output", reference], tmp_path).returncode == 0

    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_eval_at": [2, 3, "SIGTERM"]})
    assert proc.returncode == 75, show(proc)
    assert "fault_runner: eval at step 2: 3 batches" in proc.stderr, show(proc)  # of 6: stopped at the next one
    assert "checkpoint step-00000002 saved" in proc.stderr, show(proc)
    assert visible_steps(run) == [2]
    assert [r["step"] for r in records(run) if "eval_loss" in r] == [0]  # the stopped evaluation is not logged

    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "eval at step 2" in proc.stdout and "step-00000002 (step 2 of 6)" in proc.stdout, show(proc)
    assert records(run) == records(reference)
    assert [r["step"] for r in records(run) if "eval_loss" in r] == [0, 2, 4, 6]


def test_a_run_stopped_during_set_up_starts_again_with_events_of_its_own(tmp_path, finetune_config):
    """A SIGTERM during the evaluation before training logs no metrics record, only its stop event: the same command
    started again from step 0 and appended to that events.jsonl, where docs/reliability.md says the attempt's files
    move to attempts/N (as they do for a run killed after logging steps)."""
    finetune_config["train"]["max_steps"] = 2
    config = write_config(tmp_path / "finetune.yaml", finetune_config)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_eval": "SIGTERM"})
    assert proc.returncode == 75, show(proc)
    assert "stop" in [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]

    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "starting again from step 0" in " ".join(proc.stdout.split()), show(proc)
    events = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "stop" not in events and "checkpoint" in events, events
    moved = run / "attempts" / "1" / "events.jsonl"
    assert "stop" in [json.loads(line)["event"] for line in moved.read_text().splitlines()]
