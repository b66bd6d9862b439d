"""``trainforge train --nproc N``: the same command under torchrun, on this machine."""

from __future__ import annotations

import os
import sys


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node N -m trainforge train ARGS``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",  # a local rendezvous on a free port: no master address to pick
        f"--nproc_per_node={nproc}",
        "-m", "trainforge", "train", *train_args,
    ]


def launch_torchrun(nproc: int, train_args: list[str]) -> None:
    """Become torchrun (exec): signals reach it directly and it stops every process when one fails;
    its exit code is the job's."""
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun would set 1: share this machine's cores between the processes
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    sys.stdout.flush()
    sys.stderr.flush()
    cmd = torchrun_command(nproc, train_args)
    os.execv(cmd[0], cmd)
