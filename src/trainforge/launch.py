"""``trainforge train --nproc N``: the same command under torchrun, on this machine, ending with
the workers' own exit code.

torchrun itself exits 1 whenever a worker fails, which would hide trainforge's codes (2 bad
input, 3 non-finite, 4 out of memory, 75 preempted) from the scheduler or script that decides
what to do next. So the launcher runs torchrun as a child, hands every worker a directory
(``TRAINFORGE_EXIT_DIR``) where it leaves its exit code, forwards SIGTERM/SIGINT to torchrun
(which passes them on to the workers: each saves and exits 75), and exits with the workers'
code.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import EXIT_CODES, EXIT_OK, EXIT_UNEXPECTED

EXIT_DIR_ENV = "TRAINFORGE_EXIT_DIR"
MEANINGFUL = tuple(c for c in EXIT_CODES if c not in (EXIT_OK, EXIT_UNEXPECTED))  # they say what to do next


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """torchrun (``torch.distributed.run``, through ``torchrun_quiet``, which leaves out its traceback on a
    signal) ``--standalone --nproc_per_node N -m trainforge train ARGS``."""
    return [
        sys.executable, "-m", "trainforge.torchrun_quiet",
        "--standalone",  # a local rendezvous on a free port: no master address to pick
        f"--nproc_per_node={nproc}",
        "-m", "trainforge", "train", *train_args,
    ]


def record_exit_code(code: int) -> None:
    """In a worker started by ``launch``: leave this rank's exit code for the launcher."""
    where = os.environ.get(EXIT_DIR_ENV)
    if where:
        try:
            (Path(where) / f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))
        except OSError:
            pass  # the launcher then reports torchrun's own code


def wait_for_rank_zero(seconds: float) -> None:
    """In a worker that met an error every rank meets alike: wait up to ``seconds`` for rank 0 to print it. torchrun
    stops every other process with SIGTERM once rank 0 exits; that ends the wait early and quietly (this is no
    stop of the run: no "stopped" line, no traceback), and the caller exits with the error's own code."""

    def stopped(signum: int, frame: object) -> None:
        raise InterruptedError  # ends the sleep; caught below

    signals = (signal.SIGTERM, signal.SIGINT)
    try:
        for s in signals:
            signal.signal(s, stopped)
        time.sleep(seconds)
    except InterruptedError:
        pass
    finally:
        for s in signals:  # the worker ends now (os._exit): a second signal changes nothing
            signal.signal(s, signal.SIG_IGN)


def job_exit_code(torchrun_code: int, rank_codes: dict[int, int]) -> int:
    """The job's exit code: 0 when torchrun succeeded; else the lowest rank's trainforge code
    (2, 3, 4, 75: ranks that fail alike agree, and a rank that failed on its own has one while
    its peers only report having been stopped), else torchrun's."""
    if torchrun_code == 0:
        return 0
    for rank in sorted(rank_codes):
        if rank_codes[rank] in MEANINGFUL:
            return rank_codes[rank]
    return torchrun_code if torchrun_code > 0 else 1


def launch(nproc: int, train_args: list[str]) -> int:
    """Run the training under torchrun with ``nproc`` local processes; returns the job's exit code."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:  # torchrun would set 1: share this machine's cores between the processes
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    exit_dir = Path(tempfile.mkdtemp(prefix="trainforge-exit-"))
    env[EXIT_DIR_ENV] = str(exit_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    # its own session: a Ctrl-C or a signal to this process group reaches torchrun once, through
    # ``forward``, not twice (a worker's second signal would stop it without saving)
    child = subprocess.Popen(torchrun_command(nproc, train_args), env=env, start_new_session=True)

    def forward(signum, frame):  # torchrun passes it to every worker, which saves and exits 75
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    ranks = {}
    for f in exit_dir.glob("rank-*"):
        try:
            ranks[int(f.name.split("-", 1)[1])] = int(f.read_text())
        except ValueError:
            pass
    shutil.rmtree(exit_dir, ignore_errors=True)
    return job_exit_code(code, ranks)
