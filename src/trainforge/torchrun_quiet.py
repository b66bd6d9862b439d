"""torchrun for ``trainforge train --nproc``: torch's own launcher, run as ``python -m trainforge.torchrun_quiet
ARGS``, without the tracebacks it prints when the job is stopped by a signal or a worker fails. The workers
have already said what happened (a stop: each saved its checkpoint and printed one "stopped" line; an error:
the failing rank printed it) and left their exit codes for ``launch``, which exits with them. A failure
becomes one line naming the process that failed first, and how (a worker killed by a signal prints nothing
itself)."""

from __future__ import annotations

import logging
import sys

# torch's log lines that ``failure_line`` says again in one line (the process that failed first; that torchrun
# stopped the others)
SAID_BY_FAILURE_LINE = ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", "Sending process %s closing signal %s")


def _not_said_again(record: logging.LogRecord) -> bool:
    return record.msg not in SAID_BY_FAILURE_LINE


def failure_line(error) -> str:
    """One line for torchrun's ``ChildFailedError``: which process failed first, with which code or signal
    (``error:`` only for a signal: a failing worker has already printed its own error line)."""
    rank, failure = error.get_first_failure()
    others = len(error.failures) - 1
    rest = f"; torchrun stopped the other {others} process(es)" if others > 0 else ""
    if failure.exitcode >= 0:  # the worker printed its own error: this line only says which one
        return f"torchrun: process rank {rank} (pid {failure.pid}) failed first, exit code {failure.exitcode} (its error is above){rest}"
    hint = " (often the kernel's out-of-memory killer: see dmesg)" if failure.signal_name() == "SIGKILL" else ""
    return f"error: process rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}{hint}{rest}"


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_said_again)
    try:
        torchrun()
    except SignalException as e:  # SIGINT/SIGTERM forwarded by ``launch``: torchrun stopped its workers
        return 128 + int(e.sigval)
    except ChildFailedError as e:  # the workers printed their errors; torchrun's traceback would bury them
        print(failure_line(e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
