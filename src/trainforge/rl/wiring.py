"""Where a grpo run's set-up differs from the token store's: prompts instead of packed rows, the rollout stage
instead of the train loader, bound to the policy once it is built (engine/setup.py calls these three)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..data.loader import TrainLoader
from ..data.plan import plan_data
from .prompts import check_room, plan_prompts
from .stage import RolloutLoader


def data_planner(cfg: Any) -> Callable[..., Any]:
    """``plan_data``, or for grpo ``plan_prompts`` once the completions are known to fit the model's positions."""
    if cfg.train.objective != "grpo":
        return plan_data
    check_room(cfg)
    return plan_prompts


def loader_type(cfg: Any) -> type:
    return RolloutLoader if cfg.train.objective == "grpo" else TrainLoader


def bind_rollouts(cfg: Any, loader: Any, model: torch.nn.Module, objective: Any, tokenizer, precision: Any,
                  device: torch.device, grad_accum: int) -> None:
    """Give the rollout stage its policy (the model unwrapped: sampling needs no gradient exchange)."""
    if isinstance(loader, RolloutLoader):
        loader.bind(cfg, model, objective, tokenizer, precision, device, grad_accum)
