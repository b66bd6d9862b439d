"""SIGTERM while the data is tokenized: ``prepare`` and ``train`` stop with exit 75, their tokenizer
workers go away with them, and the cache holds no entry, complete-looking or hidden.

``prepare`` once had no stop handler (exit 143) and both left their forked workers behind for good,
re-parented to pid 1, blocked writing results nobody read."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from integration_helpers import cli_command, root_conftest

conftest = root_conftest()
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
WAIT_S = 180  # liveness bound of the waits below, not a speed measure
GONE_WITHIN_S = 10.0
ROWS = 30_000  # enough that tokenizing on 2 workers lasts seconds past the signal


def proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None and stat[1] == str(pid):
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie: killed, not yet reaped by whoever adopted it


@pytest.fixture(scope="module")
def big_data(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = conftest.WORDS + "the of and to in is for on with as by".split()
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    with path.open("w") as f:
        for i in range(ROWS):
            text = f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randrange(20, 200))) + "."
            f.write(json.dumps({"text": text}) + "\n")
    return path


def signal_while_tokenizing(tmp_path: Path, args: list, signum: int = signal.SIGTERM) -> tuple[int, str, str, list[int]]:
    """Start the CLI, wait for "data: tokenizing" and its two workers, send ``signum``; returns
    (exit code, stdout, stderr, the workers' pids)."""
    argv, env = cli_command(args)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=o, stderr=e)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while "data: tokenizing" not in out.read_text() or len(workers := children(proc.pid)) < 2:
            assert proc.poll() is None, f"ended before tokenizing with 2 workers:\n{out.read_text()}\n{err.read_text()}"
            assert time.monotonic() < deadline, "tokenizing with 2 workers did not start"
            time.sleep(0.05)
        time.sleep(0.5)  # the workers are tokenizing
        os.kill(proc.pid, signum)
        code = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := [p for p in workers if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # a failure leaves no orphan behind
        os.kill(pid, signal.SIGKILL)
    assert not left, f"tokenizer workers {left} outlived the process ({code})"
    return code, out.read_text(), err.read_text(), workers


def config_for(tmp_path: Path, data: Path, tokenizer: Path) -> Path:
    return conftest.write_config(tmp_path / "big.yaml", {
        "model": {"init": conftest.TINY_LLAMA_INIT, "tokenizer": str(tokenizer)},
        "data": {"train": str(data), "max_length": 64, "num_workers": 2, "cache_dir": str(tmp_path / "cache")},
        "train": {"max_steps": 2, "micro_batch_size": 4, "precision": "fp32", "device": "cpu"},
        "log": {"report": False},
    })


def assert_nothing_cached(cache: Path) -> None:
    entries = sorted(p.name for p in (cache / "data").iterdir()) if (cache / "data").is_dir() else []
    assert entries == [], f"the cache holds {entries} after a stopped build"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_prepare_tokenizes_stops_it_and_its_workers(tmp_path, big_data, tiny_tokenizer_dir, signum):
    config = config_for(tmp_path, big_data, tiny_tokenizer_dir)
    code, out, err, _ = signal_while_tokenizing(tmp_path, ["prepare", config], signum)
    name = signal.Signals(signum).name
    assert code == 75, f"exit {code}\n{out}\n{err}"
    message = " ".join(err.split())
    assert f"{name} while preparing the data" in message and "before the token cache entry was complete" in message, err
    assert "run the same command again" in message and "Traceback" not in err, err
    assert_nothing_cached(tmp_path / "cache")


def test_sigterm_while_train_tokenizes_stops_it_and_its_workers(tmp_path, big_data, tiny_tokenizer_dir):
    config = config_for(tmp_path, big_data, tiny_tokenizer_dir)
    code, out, err, _ = signal_while_tokenizing(tmp_path, ["train", config, "--output", tmp_path / "run"])
    assert code == 75, f"exit {code}\n{out}\n{err}"
    assert "SIGTERM during set-up, before the first step" in " ".join(err.split()), err
    assert_nothing_cached(tmp_path / "cache")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_workers_of_a_killed_train_die_with_it(tmp_path, big_data, tiny_tokenizer_dir):
    """SIGKILL: no handler runs; the workers are told by the kernel (PR_SET_PDEATHSIG). The build's hidden
    temporary stays until the next build removes it."""
    config = config_for(tmp_path, big_data, tiny_tokenizer_dir)
    code, out, err, _ = signal_while_tokenizing(tmp_path, ["train", config, "--output", tmp_path / "run"], signal.SIGKILL)
    assert code == -signal.SIGKILL, f"exit {code}\n{out}\n{err}"
    assert [p.name for p in (tmp_path / "cache" / "data").iterdir() if not p.name.startswith(".")] == []
