"""Two launches at once, as clusters do it: real ``trainforge`` processes, no mocks.

- a double launch: the second exits 2 at once naming the first, which finishes with each step once;
- the holder killed with SIGKILL: a new launch takes over once the lease ran out and resumes exactly;
- a requeue: SIGTERM the holder and start the new job at once; it waits for the holder's save and
  resumes from the checkpoint written on SIGTERM;
- four ``prepare`` runs into an empty cache: one cache entry for the same data, no waiting for another's.

A holder is held still inside a step (``pause_in_step``) or a cache build (``pause_in_build``) by
fault_runner.py, so every interleaving below is forced, not hoped for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from integration_helpers import root_conftest, run_cli, show, start_cli

from trainforge.rundir.checkpoint import scan_checkpoints
from trainforge.config.run import RunConfig
from trainforge.rundir.atomic import boot_id, host_name, process_tag
from trainforge.rundir.lock import LEASE_FILE, TIMEOUT_ENV

conftest = root_conftest()
WAIT_S = 300  # liveness bound of every wait below (never a measure of speed)


@pytest.fixture(scope="module")
def train_config(tmp_path_factory, tiny_tokenizer_dir, toy_data_dir) -> dict:
    return {
        "model": {
            "init": {**conftest.TINY_LLAMA_INIT, "attention_dropout": 0.1},
            "tokenizer": str(tiny_tokenizer_dir),
        },
        "data": {"train": str(toy_data_dir / "pc_train.jsonl"), "max_length": 64},
        "train": {"max_steps": 8, "micro_batch_size": 4, "grad_accum": 1, "precision": "fp32", "device": "cpu"},
        "optim": {"lr": 1.0e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 5},
        "log": {"every_steps": 1, "report": False},
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train_config) -> Path:
    """The same run, uninterrupted and alone."""
    from rich.console import Console

    from trainforge.engine.trainer import train
    from trainforge.metrics.console import ConsoleReporter

    out = tmp_path_factory.mktemp("reference") / "run"
    train(RunConfig.model_validate(train_config), out, ConsoleReporter(Console(quiet=True)))
    return out


def wait_for(path: Path, proc: subprocess.Popen | None = None) -> None:
    """Until ``path`` exists (bounded); fails early when ``proc`` ended instead."""
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended before {path.name} appeared: exit {proc.returncode}\n{out}\n{err}")
        assert time.monotonic() < deadline, f"{path} did not appear within {WAIT_S}s"
        time.sleep(0.05)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=WAIT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def train_steps(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def final_state(run: Path) -> dict:
    steps = [c.step for c in scan_checkpoints(run / "checkpoints")[0]]
    return torch.load(run / "checkpoints" / f"step-{steps[-1]:08d}" / "state.pt")


def assert_same_weights(run: Path, reference: Path) -> None:
    got, expected = final_state(run), final_state(reference)
    assert got["counters"]["step"] == expected["counters"]["step"]
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), f"weight {name} differs from the uninterrupted run"
    assert torch.equal(got["rng"]["torch"], expected["rng"]["torch"])


def edit_lease(run: Path, **fields) -> dict:
    """Rewrite fields of the lease, as a holder on another host would have left it."""
    lease = json.loads((run / LEASE_FILE).read_text())
    lease.update(fields)
    (run / LEASE_FILE).write_text(json.dumps(lease))
    return lease


def test_double_launch_second_exits_2_naming_the_first(tmp_path, train_config):
    config = conftest.write_config(tmp_path / "d.yaml", train_config)
    run, go = tmp_path / "run", tmp_path / "go"
    first = start_cli(["train", config, "--output", run], tmp_path, faults={"pause_in_step": [3, str(go)]})
    try:
        wait_for(Path(f"{go}.paused"), first)  # the first is training, inside step 3

        second = run_cli(["train", config, "--output", run], tmp_path, timeout=WAIT_S)
        assert second.returncode == 2, show(second)
        message = " ".join(second.stderr.split())
        assert f"pid {first.pid} on host" in message and "is in use by another trainforge run" in message, show(second)
        assert "d.yaml --output" in message and "since" in message, show(second)
        assert "resuming" not in second.stdout and "tokenizing" not in second.stdout, show(second)
    finally:
        go.touch()
        done = finish(first)
    assert done.returncode == 0, show(done)
    steps = train_steps(run)
    assert steps == list(range(1, 9)), f"each step once, in order: {steps}"
    assert not (run / LEASE_FILE).exists()  # released at the end
    assert not [p.name for p in run.rglob(".*") if ".tmp" in p.name], "temporaries left behind"


def test_killed_holder_is_taken_over_after_the_lease_runs_out_and_resumes_exactly(
    tmp_path, train_config, reference, monkeypatch
):
    config = conftest.write_config(tmp_path / "d.yaml", train_config)
    run, go = tmp_path / "run", tmp_path / "go"
    monkeypatch.setenv(TIMEOUT_ENV, "3")  # the holder records it; the newcomers judge by the holder's value
    holder = start_cli(["train", config, "--output", run], tmp_path, faults={"pause_in_step": [5, str(go)]})
    wait_for(Path(f"{go}.paused"), holder)
    holder.kill()
    assert finish(holder).returncode == -signal.SIGKILL
    assert [c.step for c in scan_checkpoints(run / "checkpoints")[0]] == [2, 4]

    # the dead holder, as it looks from another host (its pid cannot be checked there), renewed just now
    lease = edit_lease(run, host="other-node", timeout_s=3600)
    proc = run_cli(["train", config, "--output", run], tmp_path, timeout=WAIT_S)
    assert proc.returncode == 2, show(proc)
    message = " ".join(proc.stderr.split())
    assert f"pid {lease['pid']} on host other-node" in message and "expires 3600s after its last renewal" in message, show(proc)

    # the lease runs out 3 s after the holder's last renewal: the next launch takes over and resumes
    edit_lease(run, timeout_s=3)
    while time.time() - lease["renewed_at"] <= 3:
        time.sleep(0.1)
    proc = run_cli(["train", config, "--output", run], tmp_path, timeout=WAIT_S)
    assert proc.returncode == 0, show(proc)
    log = " ".join((proc.stdout + proc.stderr).split())
    assert "took over the lease" in log and "other-node" in log and "presumed dead" in log, show(proc)
    assert "resuming from" in log and "step-00000004" in log, show(proc)
    assert train_steps(run) == list(range(1, 9))
    assert_same_weights(run, reference)
    assert not (run / LEASE_FILE).exists()


def test_same_host_dead_holder_is_taken_over_at_once(tmp_path, train_config, reference):
    config = conftest.write_config(tmp_path / "d.yaml", train_config)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_step": [3, "SIGKILL"]}, timeout=WAIT_S)
    assert proc.returncode == -signal.SIGKILL, show(proc)
    assert (run / LEASE_FILE).exists()  # left behind by the killed holder (default timeout: minutes)
    proc = run_cli(["train", config, "--output", run], tmp_path, timeout=WAIT_S)
    assert proc.returncode == 0, show(proc)
    log = " ".join((proc.stdout + proc.stderr).split())
    assert "took over the lease" in log and "no longer runs on this host" in log, show(proc)
    assert_same_weights(run, reference)


def dead_process_tag() -> str:
    """A process tag (``HOST-PID-RANDOM``, as lease tokens are) of a process of this host that has ended."""
    proc = subprocess.Popen(["python3", "-c", "pass"])
    proc.wait()
    return process_tag().rsplit("-", 2)[0] + f"-{proc.pid}-abc123"


@pytest.mark.parametrize("leftover", ["none", "markers"])
def test_a_run_killed_in_set_up_holding_only_the_lease_starts_at_the_first_retry(tmp_path, train_config, leftover):
    """A SIGKILL during set-up left only lease.json (a dead pid): the retry took the lease over, then refused its own
    .lease.json.takeover-... file as 'not a trainforge run directory'; a killed takeover's marker made it wait out
    the lease timeout. Now the first retry takes over and trains."""
    config = conftest.write_config(tmp_path / "d.yaml", train_config)
    run = tmp_path / "run"
    run.mkdir()
    token = dead_process_tag()
    pid = int(token.rsplit("-", 2)[1])
    now = time.time()
    (run / LEASE_FILE).write_text(json.dumps({
        "host": host_name(), "pid": pid, "pid_start": None, "boot_id": boot_id(), "started_at": now, "renewed_at": now,
        "timeout_s": 180.0, "command": "trainforge train d.yaml", "cwd": str(tmp_path), "token": token,
    }))
    if leftover == "markers":  # a takeover of this lease killed half-way, and the marker of an earlier lease
        (run / f".{LEASE_FILE}.takeover-{token}").write_text(dead_process_tag())
        (run / f".{LEASE_FILE}.takeover-{dead_process_tag()}").write_text(dead_process_tag())
    t0 = time.monotonic()
    proc = run_cli(["train", config, "--output", run, "--set", "train.max_steps=2"], tmp_path, timeout=WAIT_S)
    assert proc.returncode == 0, show(proc)
    assert time.monotonic() - t0 < 120  # not the lease timeout (180 s) waited out
    log = " ".join((proc.stdout + proc.stderr).split())
    assert "took over the lease" in log and "no longer runs on this host" in log, show(proc)
    assert train_steps(run) == [1, 2]
    assert not list(run.glob(f".{LEASE_FILE}*")) and not (run / LEASE_FILE).exists()


def test_requeue_waits_for_the_stopping_holder_and_resumes_from_its_last_save(tmp_path, train_config, reference):
    config = conftest.write_config(tmp_path / "d.yaml", train_config)
    run, go = tmp_path / "run", tmp_path / "go"
    old = start_cli(["train", config, "--output", run], tmp_path, faults={"pause_in_step": [5, str(go)]})
    try:
        wait_for(Path(f"{go}.paused"), old)  # inside step 5; step-4 is the newest checkpoint
        old.send_signal(signal.SIGTERM)  # the scheduler preempts it ...
        new = start_cli(["train", config, "--output", run], tmp_path)  # ... and starts the requeued job at once
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(new.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + WAIT_S
        while not any("waiting up to" in line for line in lines):  # the new job waits for the old one's save
            assert new.poll() is None, f"the new job ended without waiting: exit {new.returncode}\n{''.join(lines)}\n{new.stderr.read()}"
            assert time.monotonic() < deadline, "the new job never said it was waiting"
            time.sleep(0.05)
        assert old.poll() is None
    finally:
        go.touch()  # the old job finishes step 5, saves step-5 and exits 75
    stopped = finish(old)
    assert stopped.returncode == 75, show(stopped)
    assert "checkpoint step-00000005 saved" in stopped.stderr, show(stopped)

    new.wait(timeout=WAIT_S)
    reader.join(timeout=WAIT_S)
    log = " ".join("".join(lines).split())
    err = new.stderr.read()
    assert new.returncode == 0, f"{log}\n{err}"
    assert f"pid {old.pid}" in log and "stopping after a signal" in log, log
    assert "resuming from" in log and "step-00000005" in log and "step-00000004 " not in log, log
    assert train_steps(run) == list(range(1, 9))
    assert_same_weights(run, reference)


# ---------------------------------------------------------------- the token cache


def prepare_config(tmp_path: Path, name: str, data: Path, train_config: dict, cache: Path) -> Path:
    cfg = json.loads(json.dumps(train_config))
    cfg["data"].update(train=str(data), cache_dir=str(cache), num_workers=1)
    return conftest.write_config(tmp_path / f"{name}.yaml", cfg)


def cache_entries(cache: Path) -> tuple[list[str], list[str]]:
    names = sorted(p.name for p in (cache / "data").iterdir())
    return [n for n in names if not n.startswith(".")], [n for n in names if n.startswith(".")]


def test_four_prepares_of_the_same_data_share_one_cache_entry(tmp_path, train_config, toy_data_dir):
    cache, go = tmp_path / "cache", tmp_path / "go"
    config = prepare_config(tmp_path, "p", toy_data_dir / "pc_train.jsonl", train_config, cache)
    # the first builds and holds still before publishing, so the others build the same entry beside it
    first = start_cli(["prepare", config], tmp_path, faults={"pause_in_build": str(go)})
    wait_for(Path(f"{go}.paused"), first)
    others = [start_cli(["prepare", config], tmp_path) for _ in range(3)]
    results = [finish(p) for p in others]
    go.touch()
    results.insert(0, finish(first))
    for proc in results:
        assert proc.returncode == 0, show(proc)
    entries, hidden = cache_entries(cache)
    assert len(entries) == 1 and hidden == [], (entries, hidden)
    entry = cache / "data" / entries[0]
    for proc in results:
        assert f"cache: {entry}" in " ".join(proc.stdout.split()), show(proc)
    assert "another process finished" in results[0].stdout, show(results[0])  # the first built, lost, used the winner's
    assert json.loads((entry / "stats.json").read_text())["train_sequences"] > 0


def test_prepares_of_different_data_do_not_wait_for_each_other(tmp_path, train_config):
    cache, go = tmp_path / "cache", tmp_path / "go"
    configs = []
    for k in range(4):
        data = conftest.write_jsonl(tmp_path / f"d{k}.jsonl", conftest.toy_prompt_completions(60, seed=10 + k))
        configs.append(prepare_config(tmp_path, f"p{k}", data, train_config, cache))
    held = start_cli(["prepare", configs[0]], tmp_path, faults={"pause_in_build": str(go)})
    wait_for(Path(f"{go}.paused"), held)
    try:
        for proc in [finish(p) for p in [start_cli(["prepare", c], tmp_path) for c in configs[1:]]]:
            assert proc.returncode == 0 and "tokenizing into" in proc.stdout, show(proc)
        assert held.poll() is None  # the other three finished while the first was still building
    finally:
        go.touch()
    proc = finish(held)
    assert proc.returncode == 0, show(proc)
    entries, hidden = cache_entries(cache)
    assert len(entries) == 4 and hidden == [], (entries, hidden)


def test_a_killed_prepare_leaves_a_temporary_the_next_one_removes(tmp_path, train_config, toy_data_dir):
    cache, go = tmp_path / "cache", tmp_path / "go"
    config = prepare_config(tmp_path, "p", toy_data_dir / "pc_train.jsonl", train_config, cache)
    victim = start_cli(["prepare", config], tmp_path, faults={"pause_in_build": str(go)})
    wait_for(Path(f"{go}.paused"), victim)
    os.kill(victim.pid, signal.SIGKILL)
    finish(victim)
    assert len(cache_entries(cache)[1]) == 1  # its temporary, named after its pid
    proc = run_cli(["prepare", config], tmp_path, timeout=WAIT_S)
    assert proc.returncode == 0 and "tokenizing into" in proc.stdout, show(proc)
    entries, hidden = cache_entries(cache)
    assert len(entries) == 1 and hidden == [], (entries, hidden)
