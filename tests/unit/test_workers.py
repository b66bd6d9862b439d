"""Tokenizer worker processes die with their parent, leave SIGTERM/SIGINT to it, and stop on demand.

Orphans once outlived a killed ``prepare``/``train`` forever, blocked writing to a pipe nobody read
(~350 MB each), ignoring SIGTERM through the handler they inherited."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainforge.data.workers import ORPHAN_EXIT_CODE, init_worker, stop_pool, worker_pool

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
GONE_WITHIN_S = 10.0  # liveness bound, not a speed measure


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, killed but not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: list[int], within_s: float = GONE_WITHIN_S) -> list[int]:
    """The pids of ``pids`` still running after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


PARENT = textwrap.dedent(
    """
    import os, sys, time
    import trainforge.data.workers as workers

    def nap(_):
        time.sleep(120)  # busy as a worker is when its parent dies mid-tokenizing

    if sys.argv[1] == "no-prctl":  # as on a system without PR_SET_PDEATHSIG: the watching thread does it
        workers.set_parent_death_signal = lambda *a: False
    pool = workers.worker_pool(2)
    for _ in range(2):
        pool.submit(nap, None)
    while len(pool._processes) < 2 or not all(p.is_alive() for p in pool._processes.values()):
        time.sleep(0.05)
    time.sleep(0.5)  # the initializers ran
    print(" ".join(str(pid) for pid in pool._processes), flush=True)
    sys.stdin.readline()  # the test saw the workers
    if sys.argv[2] == "exit":
        os._exit(0)
    time.sleep(120)  # killed by the test
    """
)


@pytest.mark.parametrize("tie", ["prctl", "no-prctl"])
@pytest.mark.parametrize("death", ["exit", "SIGKILL"])
def test_workers_die_with_their_parent(tmp_path, tie, death):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), tie, death], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    workers: list[int] = []
    try:
        line = parent.stdout.readline()
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2 and all(alive(p) for p in workers), line
        parent.stdin.write("die\n")
        parent.stdin.flush()
        if death == "SIGKILL":
            parent.kill()
        parent.wait(timeout=GONE_WITHIN_S)
        left = wait_gone(workers)
        assert not left, f"workers {left} outlived their parent ({death}, {tie})"
    finally:
        parent.kill()
        parent.wait()
        for pid in filter(alive, workers):  # a failure leaves no orphan behind
            os.kill(pid, signal.SIGKILL)


def test_a_worker_whose_parent_died_before_it_started_watching_exits():
    """The parent may die between the fork and PR_SET_PDEATHSIG: the worker checks whose child it is."""
    child = multiprocessing.get_context("fork").Process(target=init_worker, args=(os.getpid() + 10**7,))
    child.start()
    child.join(GONE_WITHIN_S)
    assert child.exitcode == ORPHAN_EXIT_CODE


def _dispositions(_: object) -> tuple[object, object]:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def _nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (SigIgn of /proc/PID/status)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_workers_leave_sigterm_and_sigint_to_the_parent():
    """A fork inherits the parent's handlers (StopRequest's sets a flag and carries on, pytest's raises
    KeyboardInterrupt); the workers ignore both signals from the moment they are forked, so a signal to the
    whole process group reaches the parent alone, which decides."""
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        pool = worker_pool(2)
        pids = list(pool._processes)  # forked already, signals blocked until they ignore them
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        assert pool.submit(_dispositions, None).result(timeout=60) == (signal.SIG_IGN, signal.SIG_IGN)
        assert pool.submit(_nap, 0.1).result(timeout=60) == 0.1  # still working
        deadline = time.monotonic() + GONE_WITHIN_S
        while not all({signal.SIGTERM, signal.SIGINT} <= ignored_signals(p) for p in pids):
            assert time.monotonic() < deadline, [ignored_signals(p) for p in pids]
            time.sleep(0.05)
        assert all(alive(p) for p in pids)
        pool.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_pool_cancels_waiting_work_and_kills_workers_that_do_not_finish():
    pool = worker_pool(2)
    running = [pool.submit(_nap, 120) for _ in range(2)]
    waiting = [pool.submit(_nap, 120) for _ in range(4)]
    while sum(f.running() for f in running) < 2:
        time.sleep(0.05)
    pids, manager = list(pool._processes), pool._executor_manager_thread
    t = time.monotonic()
    stop_pool(pool, wait_s=0.5)
    assert time.monotonic() - t < GONE_WITHIN_S
    assert not wait_gone(pids, 0.0) and not manager.is_alive()
    # cancelled, or failed with the killed workers when the pool had queued them for a worker already
    assert all(f.cancelled() or f.exception(timeout=0) is not None for f in running + waiting)
    assert any(f.cancelled() for f in waiting)


def test_stop_pool_lets_workers_finish_the_calls_they_hold():
    pool = worker_pool(2)
    futures = [pool.submit(_nap, 0.2) for _ in range(2)]
    while not all(f.running() for f in futures):
        time.sleep(0.05)
    processes = list(pool._processes.values())
    stop_pool(pool)
    assert [p.exitcode for p in processes] == [0, 0]  # the end marker, not a kill

