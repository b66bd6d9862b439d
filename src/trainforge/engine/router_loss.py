"""The router load-balancing (aux) loss of a mixture-of-experts model, as transformers defines it.

transformers adds ``router_aux_loss_coef x load_balancing_loss_func(router_logits, ...)`` to a MoE model's
loss only when asked (``output_router_logits``). Here every training forward asks for the router logits
(on the chunked-head path too, which calls the decoder itself) and the model family's own
``load_balancing_loss_func`` computes the loss over the micro-batch's real tokens (the padding fill of a
row excluded: its attention mask).

Accumulation: a micro-batch's aux loss is weighted by its share of the step's target tokens, the divisor
of the cross-entropy, so a step of one micro-batch trains exactly transformers' ``loss`` (mean
cross-entropy + coef x aux) and one of several trains the target-token-weighted mean of their aux losses.
The logged ``loss`` stays the cross-entropy (comparable with ``eval_loss`` and with dense runs); the aux
loss (before its coefficient) is logged apart as ``aux_loss``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from ..data.loader import Batch
from ..model.moe import routing

AUX, AUX_UNITS = "aux_loss", "aux_loss#units"  # window sums: aux x target tokens, and the target tokens


class RouterLoss:
    """The aux term of one model: its family's function, experts, experts per token and coefficient."""

    def __init__(self, fn: Callable[..., Any], num_experts: int, top_k: int, coef: float):
        self.fn, self.num_experts, self.top_k, self.coef = fn, num_experts, top_k, coef

    def add(self, ce_sum: torch.Tensor, router_logits: Any, batch: Batch,
            metrics: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """``ce_sum`` with this micro-batch's aux term in its gradient (its value unchanged); the aux loss
        to ``metrics``. Every micro-batch adds the same keys (zero without real tokens): data-parallel ranks
        all-reduce the same sums."""
        weight = float(batch.n_targets)
        if batch.n_tokens and weight and router_logits:
            mask = batch.real if batch.real is not None else None
            aux = self.fn(tuple(router_logits), self.num_experts, self.top_k, mask)
            aux = aux.float() if torch.is_tensor(aux) else torch.zeros((), device=ce_sum.device)
        else:  # a data-parallel rank's empty share: nothing routed that counts
            aux, weight = torch.zeros((), device=ce_sum.device), 0.0
        if metrics is not None:
            metrics[AUX] = metrics.get(AUX, 0) + aux.detach() * weight
            metrics[AUX_UNITS] = metrics.get(AUX_UNITS, 0) + torch.tensor(weight, device=ce_sum.device)
        term = self.coef * aux * weight  # forward_backward divides the sum by the step's target tokens
        # the gradient gets the term, the value does not: term - term.detach() is exactly 0, so the summed
        # loss (logged, checked for non-finite values) stays the cross-entropy's
        return ce_sum + (term - term.detach())


def router_loss_for(model: torch.nn.Module, enabled: bool = True) -> RouterLoss | None:
    """The model's router aux loss, or None: switched off, a dense model, or a family transformers gives
    no ``load_balancing_loss_func`` or no recorded router logits (aux-loss-free routing, DeepSeek-V3's)."""
    if not enabled:
        return None
    base = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    config = getattr(base, "config", None)
    found = routing(config) if config is not None else None
    fn = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    records = getattr(base, "_can_record_outputs", None) or {}
    if found is None or fn is None or "router_logits" not in records:
        return None
    text = getattr(config, "text_config", None) or config
    coef = getattr(text, "router_aux_loss_coef", None)
    return RouterLoss(fn, found[1], found[2], float(coef if coef is not None else 0.0))


def router_means(sums: dict[str, torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """``{"aux_loss": ...}``: the window's target-token-weighted mean aux loss (all ranks' sums with ``reduce``);
    empty when the run has no router loss."""
    if AUX not in sums:
        return {}
    stacked = torch.stack([torch.as_tensor(sums[AUX]).float().reshape(()), torch.as_tensor(sums[AUX_UNITS]).float().reshape(())])
    aux, units = (reduce(stacked) if reduce is not None else stacked).tolist()
    return {AUX: aux / units} if units else {AUX: float("nan")}
