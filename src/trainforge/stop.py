"""SIGTERM / SIGINT: finish the step, save, exit; a second signal ends the process at once."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

from .errors import EXIT_INTERRUPTED, TrainforgeError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(TrainforgeError):
    """The run stopped on a signal after saving a checkpoint; running the same command resumes it."""

    exit_code = EXIT_INTERRUPTED
    label = "stopped"

    def __init__(self, message: str, signal_name: str = "") -> None:
        super().__init__(message)
        self.signal_name = signal_name  # "SIGTERM" or "SIGINT": a tool running several runs stops all of them on it


class StopRequest:
    """Context manager that turns the first SIGTERM/SIGINT into a flag the training loop checks.

    The handler only sets the flag and hands both signals back to the operating system's
    default action, so a second signal kills the process at once, even inside a long C call
    such as a checkpoint write; checkpoints are written atomically, so that leaves no
    visible partial one behind.
    """

    def __init__(self, doing: str | None = None, quick: bool = False) -> None:
        """``doing``: what the process does on the first signal, for its message (default: a run's own words).
        ``quick``: the process stops within a moment of any signal (a tool waiting on a child it then kills and
        cleans up after), so a second signal is taken as the first was, not as "stop at once"."""
        self.signum: int | None = None
        self.stepping = False  # set by the training loop: before it, a signal has no step to finish nor to save
        self.doing, self.quick = doing, quick
        # called with the signal's name when the first one comes (a run records it in events.jsonl: if a second
        # signal or a SIGKILL ends the process before its stop is saved, ``doctor`` still knows a signal came)
        self.on_signal: Callable[[str], None] | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.quick and self.signum is not None:
            return  # said once; the stop is under way
        self.signum = signum
        if not self.quick:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_DFL)
        # os.write, not the console: a handler can interrupt a print that holds the console's lock
        doing = self.doing or (
            "finishing the current step, then saving a checkpoint (send it again to stop at once, without saving)"
            if self.stepping else "stopping at the end of this stage of set-up, before any step: nothing to save "
            "(send it again to stop at once)")
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets the signal: rank 0 says it, once
            os.write(2, f"\n{signal.Signals(signum).name}: {doing}\n".encode())
        if self.on_signal is not None:
            try:
                self.on_signal(self.name)
            except Exception:  # noqa: BLE001 - a record that fails (a full disk) must not turn the stop into a crash
                pass

    def stop_before_training(self, out: object, distributed: bool = False) -> None:
        """A signal during set-up: stop at this stage's end rather than tokenize, load, evaluate and save
        on (a checkpoint of step 0, or of the step just resumed, holds nothing new). ``distributed``: not here;
        the ranks agree on a stop at the first step (one rank stopping alone would leave the others in a collective)."""
        if self.requested and not distributed:
            raise Interrupted(f"{self.name} during set-up, before the first step: nothing trained, nothing saved; "
                              f"to go on, run the same command with --output {out}", self.name)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
