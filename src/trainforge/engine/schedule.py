"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def lr_factor(schedule: str, warmup_steps: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr for step ``s`` (0-based: the lr used by the (s+1)-th update)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * decay

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, max_steps: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, warmup_steps, max_steps, min_ratio))
