"""`trainforge bench` through the CLI: a table, a JSON file, one result per variant."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from integration_helpers import cli_command, root_conftest, run_cli, show

write_config = root_conftest().write_config


def test_bench_sweep_writes_json(tmp_path, finetune_config):
    config = write_config(tmp_path / "run.yaml", finetune_config)
    out = tmp_path / "bench.json"
    proc = run_cli(
        ["bench", config, "--sweep", "train.micro_batch_size=2,4", "--steps", "3", "--warmup", "1", "--synthetic", "--out", out],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, show(proc)
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout, show(proc)
    results = json.loads(out.read_text())
    assert [r["overrides"] for r in results] == [
        ["train.micro_batch_size=2", "train.grad_accum=4"],
        ["train.micro_batch_size=4", "train.grad_accum=2"],
    ]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and 0 <= r["data_wait_pct"] <= 100
    # the same global batch over the same rows: the same loss, whatever the micro-batch
    assert abs(results[0]["loss"] - results[1]["loss"]) < 1e-4
    assert not (tmp_path / "checkpoints").exists()


def test_bench_leaves_no_run_directories_behind(tmp_path, finetune_config):
    """Each variant is a whole run (final/ weights included: GBs for a real model); bench kept them all in
    /tmp/trainforge-bench-* for good."""
    config = write_config(tmp_path / "run.yaml", finetune_config)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv, env = cli_command(["bench", config, "--steps", "2", "--warmup", "1", "--synthetic"])
    proc = subprocess.run(argv, cwd=tmp_path, env={**env, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, show(proc)
    assert not list(tmp.glob("trainforge-bench-*")), show(proc)


@pytest.mark.parametrize("how", ["sigterm-to-bench", "ctrl-c-to-its-group", "ctrl-c-twice"])
def test_a_signal_stops_the_whole_bench(tmp_path, finetune_config, how):
    """SIGTERM to bench (a job's time limit) or Ctrl-C (SIGINT to bench and its variant's process) stops it with exit 75:
    the variant running is killed, the next never starts, the run directories are removed. Before, SIGTERM killed
    bench alone and its variant ran on; Ctrl-C stopped the variant (saving a checkpoint in the temporary directory)
    and bench went on with the next. Ctrl-C twice in a moment once killed bench and left its variant training alone."""
    config = write_config(tmp_path / "run.yaml", finetune_config)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv, env = cli_command(["bench", config, "--steps", "100000", "--warmup", "1", "--synthetic", "--sweep",
                             "train.micro_batch_size=2,4"])
    proc = subprocess.Popen(argv, cwd=tmp_path, env={**env, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not list(tmp.glob("trainforge-bench-*/v0/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the first variant's run has started
    assert proc.poll() is None, proc.communicate()
    if how == "sigterm-to-bench":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
        if how == "ctrl-c-twice":
            time.sleep(0.03)
            os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    shown_output = f"stdout:\n{out}\nstderr:\n{err}"
    name = "SIGTERM" if how == "sigterm-to-bench" else "SIGINT"
    assert proc.returncode == 75, shown_output
    assert f"bench stopped by {name} after 0 of 2 variants" in err and "saving a checkpoint" not in err, shown_output
    assert not list(tmp.glob("trainforge-bench-*")), shown_output
    # the variant's process (multiprocessing's spawn_main) is gone; its resource tracker may take a moment to follow
    variant = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    assert not variant, f"a variant's process runs on: {variant}"


def test_a_variant_ends_with_its_bench_when_bench_is_killed(tmp_path, finetune_config):
    """bench killed at once (SIGKILL: no handler, no clean-up): its variant, which ignores SIGTERM and SIGINT for
    bench to answer them, ends too instead of measuring on alone."""
    config = write_config(tmp_path / "run.yaml", finetune_config)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv, env = cli_command(["bench", config, "--steps", "100000", "--warmup", "1", "--synthetic"])
    proc = subprocess.Popen(argv, cwd=tmp_path, env={**env, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not list(tmp.glob("trainforge-bench-*/v0/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    deadline, left = time.monotonic() + 10, "?"
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    assert not left, f"the variant runs on without bench: {left}"


@pytest.mark.parametrize("command", [["selftest", "--quick"], ["bench", "--steps", "1", "--warmup", "1"]])
def test_an_out_that_cannot_be_written_is_refused_before_the_work(tmp_path, command):
    """`--out` into a directory, or below a file, printed a traceback and exit 1 after all the work (exit 1 means a
    path or variant failed): now exit 2 at once, naming the path."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    for out, said in ((tmp_path / "adir", "is a directory"), (tmp_path / "afile" / "r.json", "cannot make its directory")):
        proc = run_cli([*command, "--out", out], tmp_path)
        assert proc.returncode == 2, show(proc)
        assert said in proc.stderr and "Traceback" not in proc.stderr, show(proc)
        assert not proc.stdout.strip(), show(proc)  # refused before any work: no table


def test_a_sweep_value_train_would_refuse_is_refused_by_name_before_any_variant_runs(tmp_path):
    """--sweep train.micro_batch_size=0,1 ended in a ZeroDivisionError traceback, and =-1 named train.grad_accum given
    -2, a value never set: each value is now checked as train --set checks it, with the same message, first."""
    said = run_cli(["train", "--set", "train.micro_batch_size=0", "--output", tmp_path / "never"], tmp_path)
    assert said.returncode == 2, show(said)
    line = said.stderr.strip().splitlines()[-1]
    assert "train.micro_batch_size: must be a positive number" in line, show(said)
    for values, named in (("0,1", "0"), ("1,-1", "-1"), ("2,x", "x")):
        proc = run_cli(["bench", "--sweep", f"train.micro_batch_size={values}", "--steps", "1", "--warmup", "1"], tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, show(proc)
        assert f"--sweep train.micro_batch_size={named}:" in proc.stderr, show(proc)
        assert "grad_accum" not in proc.stderr and "measured" not in proc.stdout, show(proc)
        if named == "0":
            assert line in proc.stderr, show(proc)
