"""AdamW with decay only on matrices, fused where this torch build has a fused kernel."""

from __future__ import annotations

import torch

from ..config import OptimSettings


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices and embeddings; never norms and biases (1-D tensors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, cfg: OptimSettings, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if device.type in ("cuda", "cpu"):
        try:  # one fused kernel for all parameters instead of a chain of per-tensor ops
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(groups, foreach=True, **kwargs)
