"""torchrun for ``trainforge train --nproc``: torch's own launcher, run as ``python -m trainforge.torchrun_quiet
ARGS``, without the traceback it prints when the job is stopped by a signal. The workers have already
said what happened (each saved its checkpoint and printed one "stopped" line) and left their exit codes
for ``launch``, which exits with them."""

from __future__ import annotations

import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except SignalException as e:  # SIGINT/SIGTERM forwarded by ``launch``: torchrun stopped its workers
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
