"""Selftest's one hand-wired training lifecycle: a run stopped after a checkpoint, as SIGTERM stops it.

``train_stopped_after_checkpoint`` wires ``engine.trainer``'s pieces together itself (``setup``,
``train_loop``, then the saver's and the metrics' clean-up that ``train`` would do) so that the
resume check can stop a run after step ``CHECKPOINT_EVERY``, as a preempted job stops. Moved here
unchanged from the resume check; a public lifecycle API in ``engine/`` is meant to replace it.
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
    from ...engine.preempt import Interrupted, StopRequest

    stop = StopRequest()
    run = trainer.setup(cfg, out, _StopAfter(CHECKPOINT_EVERY, stop), "never", stop)
    try:
        trainer.train_loop(run)
        raise CheckFailed(f"the run did not stop after step {CHECKPOINT_EVERY} when asked to")
    except Interrupted:
        pass
    finally:
        run.saver.close()
        run.metrics.close()
