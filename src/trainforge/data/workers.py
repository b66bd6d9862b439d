"""Worker processes that never outlive the process that forked them, and leave signals to it.

``worker_pool`` makes the forked ``ProcessPoolExecutor`` that tokenizes chunks (data/prepare.py);
``stop_pool`` ends one early. Each worker, as it starts (``init_worker``):

- ignores SIGINT and SIGTERM: the parent decides what a stop means (finish the chunk, cache nothing,
  shut the workers down). Ctrl-C in a terminal, ``kill -TERM -PGID`` and schedulers that signal every
  process of a job reach the workers too; a worker killed there may die halfway through writing its
  result, which leaves the pool's reader waiting forever. A fork also inherits the parent's handler
  (``StopRequest``, which only sets a flag). To end one worker by hand: SIGKILL, or signal the parent;
- dies with its parent: Linux's ``PR_SET_PDEATHSIG`` (SIGKILL when the thread that forked it ends, the
  parent killed with SIGKILL too), then a check that the parent is still the one that forked it (it may
  have died before the setting took hold); elsewhere a daemon thread that watches the parent's id.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from ..errors import EXIT_OUT_OF_MEMORY, TrainforgeError
from ..stop import STOP_SIGNALS  # the parent's to act on

class WorkerDied(TrainforgeError):
    """A tokenizer worker ended without a stop being asked for: the out-of-memory killer, most often."""

    exit_code = EXIT_OUT_OF_MEMORY


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_EXIT_CODE = 70  # a worker whose parent was gone before it could watch for that (sysexits EX_SOFTWARE)
PARENT_POLL_S = 1.0  # without PR_SET_PDEATHSIG: how often a worker checks that its parent lives
JOIN_S = 10.0  # how long ``stop_pool`` lets workers finish the chunks they hold before killing them


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent (the thread that forked it) ends.
    Returns False where that is not available (another system, no libc, a sandbox refusing prctl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(ORPHAN_EXIT_CODE)


def init_worker(parent_pid: int) -> None:
    """A pool worker's first act (``ProcessPoolExecutor(initializer=...)``): the signal dispositions and the
    tie to ``parent_pid`` described above."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by worker_pool while forking; now ignored
    tied = set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was set: nobody reads our results
        os._exit(ORPHAN_EXIT_CODE)
    if not tied:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` forked processes (they inherit what the parent loaded) tied to this process.
    Workers are forked by the thread that first submits work: keep the pool's use within that thread's life."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=init_worker, initargs=(os.getpid(),))
    # the first submit forks every worker: with the stop signals blocked, so that none reaches a worker before
    # init_worker ignores them (it would run the parent's handler there: a KeyboardInterrupt, a SystemExit)
    blocked = hasattr(signal, "pthread_sigmask")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if blocked else set()
    try:
        pool.submit(int)
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return pool


def stop_pool(pool: ProcessPoolExecutor, wait_s: float = JOIN_S) -> None:
    """End ``pool`` early: cancel the work not started, let the workers finish the calls they hold (at most
    ``wait_s`` seconds, then SIGKILL) and wait for them and the pool's thread; their results are dropped."""
    # private attributes: the standard library has no public way to this before Python 3.14's terminate_workers
    processes = list((getattr(pool, "_processes", None) or {}).values())
    results, manager = getattr(pool, "_result_queue", None), getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)  # each worker exits at the end marker after its current call
    deadline = time.monotonic() + wait_s
    killed = False
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            killed = True
    if killed and results is not None:
        # a worker killed halfway through writing a result leaves the pool's thread reading the rest
        # forever (and the interpreter's exit waiting on it); with no writer left, that read ends
        results._writer.close()
    if manager is not None:
        manager.join(wait_s)
