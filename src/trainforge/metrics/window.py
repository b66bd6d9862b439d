"""Sums over the steps since the last log record, kept on the device until a log step reads them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LogWindow:
    """A checkpoint keeps the whole window (``state_dict``): a run resumed mid-window logs the same
    loss, tokens, rows and data wait as an uninterrupted one, over the same span of time."""

    loss_sum: torch.Tensor  # of the steps whose loss was finite
    finite_steps: torch.Tensor
    steps: int = 0
    tokens: int = 0
    indices: list[list[int]] = field(default_factory=list)  # per step, when log.example_indices is on
    rows: int = 0  # samples (rows) trained in the window
    data_wait_s: float = 0.0  # time the loop waited for batches in the window
    carried_s: float = 0.0  # seconds the window had run before the checkpoint it was resumed from
    timed_from: float = field(default_factory=time.perf_counter)  # when its time on this process began
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # an objective's metric sums (engine/objective.py)
    # the last step's learning rate and gradient norm (a device tensor, read at the log step): a run resumed at
    # its last step logs the window its checkpoint left open with them (engine/trainer.py: log_open_window)
    last_lr: float | None = None
    last_grad_norm: torch.Tensor | None = None

    @property
    def started(self) -> float:
        """When the window began, on this process's clock: ``now - started`` is its whole span, the
        seconds carried over a resume included (the log step's rates divide by that span)."""
        return self.timed_from - self.carried_s

    @started.setter
    def started(self, t: float) -> None:
        """The window's time on this process begins at ``t`` (the loop's start); what it carried stays."""
        self.timed_from = t

    @classmethod
    def on(cls, device: torch.device) -> "LogWindow":
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))

    def add(
        self, loss: torch.Tensor, skipped: torch.Tensor, tokens: int, indices: list[int] | None, rows: int = 0, data_wait_s: float = 0.0
    ) -> None:
        """Add a step without reading the device; a skipped (non-finite) step adds no loss."""
        self.rows += rows
        self.data_wait_s += data_wait_s
        self.loss_sum += torch.where(skipped, torch.zeros_like(loss), loss)
        self.finite_steps += (~skipped).to(self.finite_steps.dtype)
        self.steps += 1
        self.tokens += tokens
        if indices is not None:
            self.indices.append(indices)

    def note_rates(self, lr: float, grad_norm: torch.Tensor) -> None:
        """The step's learning rate and gradient norm (not read from the device here)."""
        self.last_lr, self.last_grad_norm = lr, grad_norm

    def add_sums(self, sums: dict[str, torch.Tensor]) -> None:
        """Add a step's metric sums (device tensors, not read here)."""
        for key, value in sums.items():
            self.sums[key] = self.sums[key] + value.detach() if key in self.sums else value.detach().clone()

    def mean_loss(self) -> float:
        """Mean loss of the window's finite steps (NaN when none was finite); reads the device."""
        n = float(self.finite_steps)
        return float(self.loss_sum) / n if n else float("nan")

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.finite_steps.zero_()
        self.steps, self.tokens, self.indices = 0, 0, []
        self.rows, self.data_wait_s, self.sums = 0, 0.0, {}
        self.carried_s, self.timed_from = 0.0, time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_sum": self.loss_sum.detach().cpu().clone(),
            "finite_steps": self.finite_steps.detach().cpu().clone(),
            "steps": self.steps,
            "tokens": self.tokens,
            "indices": [list(i) for i in self.indices],
            "rows": self.rows,
            "data_wait_s": self.data_wait_s,
            "elapsed_s": time.perf_counter() - self.started,  # the span so far, carried into a resumed run
            "sums": {k: v.detach().cpu().clone() for k, v in self.sums.items()},
            "last_lr": self.last_lr,
            "last_grad_norm": None if self.last_grad_norm is None else float(self.last_grad_norm),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's window. One written before rows, data wait and the span were kept loads with
        none of them: its first record after the resume counts only this run's rows, wait and time."""
        self.loss_sum.copy_(state["loss_sum"])
        self.finite_steps.copy_(state["finite_steps"])
        self.steps, self.tokens, self.indices = state["steps"], state["tokens"], [list(i) for i in state["indices"]]
        self.rows, self.data_wait_s = state.get("rows", 0), state.get("data_wait_s", 0.0)
        self.carried_s, self.timed_from = state.get("elapsed_s", 0.0), time.perf_counter()
        grad_norm = state.get("last_grad_norm")  # none in checkpoints of older versions
        self.last_lr = state.get("last_lr")
        self.last_grad_norm = None if grad_norm is None else torch.tensor(grad_norm)
        self.sums = {k: v.to(self.loss_sum.device) for k, v in state.get("sums", {}).items()}
