"""A run stopped after a checkpoint, as SIGTERM stops a preempted job: what selftest's resume check continues.

It goes through the engine's public lifecycle (``open_run`` -> ``train_loop``) with its own stop
request, which the reporter below raises once step ``CHECKPOINT_EVERY`` is logged.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from .cases import CHECKPOINT_EVERY
from .reporters import quiet
from .results import CheckFailed


class _StopAfter:
    """A quiet reporter that asks the loop to stop after ``step``, as the SIGTERM handler does."""

    def __init__(self, step: int, stop):
        self._inner, self._step, self._stop = quiet(), step, stop

    def log_step(self, rec: dict[str, Any], *args: Any) -> None:
        self._inner.log_step(rec, *args)
        if rec["step"] == self._step:
            self._stop.signum = signal.SIGTERM

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def train_stopped_after_checkpoint(cfg, out: Path) -> None:
    """Train ``cfg`` into ``out`` and stop it after step ``CHECKPOINT_EVERY`` as the SIGTERM handler
    does, leaving that step's checkpoint; ``CheckFailed`` if the run does not stop there."""
    from ...engine import trainer
    from ...stop import Interrupted, StopRequest

    stop = StopRequest()
    try:
        with trainer.open_run(cfg, out, _StopAfter(CHECKPOINT_EVERY, stop), "never", stop) as run:
            trainer.train_loop(run)
        raise CheckFailed(f"the run did not stop after step {CHECKPOINT_EVERY} when asked to")
    except Interrupted:
        pass
