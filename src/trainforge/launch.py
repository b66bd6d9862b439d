"""``trainforge train --nproc N``: the same command under torchrun, on this machine."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node N -m trainforge train ARGS``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",  # a local rendezvous on a free port: no master address to pick
        f"--nproc_per_node={nproc}",
        "-m", "trainforge", "train", *train_args,
    ]


def launch_torchrun(nproc: int, train_args: list[str]) -> int:
    """Run the job and return its exit code (torchrun stops every process when one fails)."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:  # torchrun would set 1: share this machine's cores between the processes
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return subprocess.call(torchrun_command(nproc, train_args), env=env)
