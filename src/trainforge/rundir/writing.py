"""Writing into a run directory while the run goes on: a full disk (or a quota, or a directory that went
away) is the environment's fault, not a bug, so it ends the run with ``RunDirWriteError`` (exit code 2)
naming the path and what to do, never with a traceback.

The writers at the run directory's boundary wrap their writes in ``writing(path)``: metrics.jsonl and
events.jsonl (``MetricsLog``, which engine/setup.py hands it: metrics/ does not import this row),
config.yaml (engine/setup.py), final/ and summary.json (engine/trainer.py). A checkpoint that cannot be written is not one of them: the run reports it and
retries at the next interval (engine/saver.py); report.html is a warning (the run's own files are written).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from .lock import OutputDirError

FULL = (errno.ENOSPC, errno.EDQUOT)


class RunDirWriteError(OutputDirError):
    """A file or directory of the run directory could not be written mid-run (disk full, quota, ...)."""


def io_error(e: BaseException) -> OSError | None:
    """``e`` as an ``OSError``: itself, or one rebuilt from a library's text that carries an OS error code
    (safetensors: ``I/O error: No space left on device (os error 28)``); None for anything else."""
    if isinstance(e, OSError):
        return e
    found = re.search(r"\(os error (\d+)\)", str(e))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def write_error(path: Path, error: OSError) -> RunDirWriteError:
    """One paragraph: what could not be written and why, where the run stands, what to do."""
    from .checkpoint import scan_checkpoints

    path = Path(path)
    run_dir = path.parent
    why = error.strerror or str(error)
    full = error.errno in FULL
    try:
        complete, _ = scan_checkpoints(run_dir / "checkpoints")
    except OSError:
        complete = []
    if complete:
        then = f"then run the same command with --output {run_dir}: it resumes from the newest complete checkpoint, {complete[-1].path}"
    else:
        then = (f"then run the same command with --output {run_dir}: it holds no complete checkpoint to resume from, "
                "so the run starts again from step 0")
    return RunDirWriteError(
        f"cannot write {path}: {why}"
        + (f"; the disk that holds the run directory {run_dir} is full" if full else "")
        + ". The run stopped here. "
        + ("Free space on that disk (old runs, checkpoint.keep_last lower), " if full else "Make it writable, ")
        + then
    )


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a failure to write ``path`` (a file or directory right inside a run directory) into ``RunDirWriteError``."""
    try:
        yield
    except RunDirWriteError:
        raise
    except Exception as e:
        found = io_error(e)
        if found is None:
            raise
        raise write_error(path, found) from e
