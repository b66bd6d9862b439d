"""What a case or check ends with: its ``Result``, or a ``CheckOutcome`` signal that ends it early."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import EXIT_UNEXPECTED, TrainforgeError


@dataclass
class Result:
    """The outcome of one case or check, as the table and the ``--out`` JSON show it."""

    name: str
    kind: str  # "train" or "check"
    status: str = "ok"  # "ok" | "FAILED" | "skipped"
    error: str = ""
    detail: str = ""
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # per step, from metrics.jsonl
    grad_norms: list[float] = field(default_factory=list)
    overflows: list[int] = field(default_factory=list)  # fp16 steps the GradScaler skipped
    loss_gap: float | None = None  # largest |loss - fp32 loss| / fp32 loss over the compared steps
    grad_norm_gap: float | None = None
    tokens_per_s: float | None = None
    eval_loss: float | None = None

    @property
    def ok(self) -> bool:
        return self.status != "FAILED"

    def fail(self, message: str) -> None:
        self.status = "FAILED"
        self.error = f"{self.error}; {message}" if self.error else message


class CheckOutcome(TrainforgeError):
    """How a check ends other than by passing: a signal inside selftest, caught there and shown as the
    check's result (a failed check makes ``selftest`` exit 1)."""

    exit_code = EXIT_UNEXPECTED


class CheckFailed(CheckOutcome):
    """A selftest check did not hold."""


class Skip(CheckOutcome):
    """A case or check that does not apply on this device."""
