"""Sums over the steps since the last log record, kept on the device until a log step reads them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LogWindow:
    loss_sum: torch.Tensor  # of the steps whose loss was finite
    finite_steps: torch.Tensor
    steps: int = 0
    tokens: int = 0
    indices: list[list[int]] = field(default_factory=list)  # per step, when log.example_indices is on
    started: float = field(default_factory=time.perf_counter)
    rows: int = 0  # samples (rows) trained in the window
    data_wait_s: float = 0.0  # time the loop waited for batches in the window

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

    def mean_loss(self) -> float:
        """Mean loss of the window's finite steps (NaN when none was finite); reads the device."""
        n = float(self.finite_steps)
        return float(self.loss_sum) / n if n else float("nan")

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.finite_steps.zero_()
        self.steps, self.tokens, self.indices, self.started = 0, 0, [], time.perf_counter()
        self.rows, self.data_wait_s = 0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_sum": self.loss_sum.detach().cpu().clone(),
            "finite_steps": self.finite_steps.detach().cpu().clone(),
            "steps": self.steps,
            "tokens": self.tokens,
            "indices": [list(i) for i in self.indices],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum.copy_(state["loss_sum"])
        self.finite_steps.copy_(state["finite_steps"])
        self.steps, self.tokens, self.indices = state["steps"], state["tokens"], [list(i) for i in state["indices"]]
