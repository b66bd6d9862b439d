"""``trainforge train --nproc``: the job's exit code, and torchrun's failure report cut to one line."""

from __future__ import annotations

import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainforge.launch import job_exit_code
from trainforge.torchrun_quiet import failure_line


def failed(**exitcodes: int) -> ChildFailedError:
    """torchrun's error: rank -> exit code (negative: killed by that signal), failed in the order given."""
    failures = {}
    for i, (rank, code) in enumerate(exitcodes.items()):
        failures[int(rank[1:])] = f = ProcessFailure(local_rank=int(rank[1:]), pid=100 + i, exitcode=code, error_file="")
        f.timestamp = 1000 + i
    return ChildFailedError("trainforge", failures)


def test_a_worker_killed_by_a_signal_is_named_as_an_error():
    line = failure_line(failed(r1=-signal.SIGKILL, r0=1))
    assert line.startswith("error: process rank 1 (pid 100) was killed by SIGKILL"), line
    assert "out-of-memory" in line and "stopped the other 1 process(es)" in line


def test_a_worker_that_exited_with_a_code_is_named_without_a_second_error_line():
    line = failure_line(failed(r0=2, r1=-signal.SIGTERM))
    assert "error:" not in line and "process rank 0 (pid 100) failed first, exit code 2" in line, line


def test_the_job_exits_with_the_code_of_the_lowest_rank_that_has_one():
    assert job_exit_code(1, {0: 1, 1: 2}) == 2
    assert job_exit_code(1, {0: 75, 1: 75}) == 75
    assert job_exit_code(-signal.SIGKILL, {}) == 1 and job_exit_code(0, {0: 2}) == 0
