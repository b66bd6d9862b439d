"""The router losses of a mixture-of-experts model, as transformers defines them: load balancing (aux) and z-loss.

transformers adds ``router_aux_loss_coef x aux`` (and, where the family has one, ``router_z_loss_coef x z``) to a
MoE model's loss only when asked (``output_router_logits``). Here every training forward asks for the router
logits (on the chunked-head path too, which calls the decoder itself) and the terms are computed over the
micro-batch's real tokens (a row's padding fill excluded):

- decoder-only families (Qwen2/3-MoE, OLMoE, Mixtral, ...): the family's own ``load_balancing_loss_func`` with the
  real-token mask as its attention mask. None of them has a z-loss in transformers 5.
- Switch Transformers (encoder-decoder, top-1), the one family whose transformers model adds a router z-loss:
  its z-loss and its load-balancing loss per stack (the encoder's real tokens: the source; the decoder's: the
  positions with a target), summed over the two stacks as transformers does. transformers leaves out a stack
  whose sparse step is 1 (every layer sparse): so does this, to train the same objective.

Expert load: every micro-batch also counts, per MoE layer, the real tokens that chose each expert (top-k of
the router logits) on the device; the log window sums the counts and the log step turns them into each layer's
most- and least-loaded expert's share of the tokens (``expert_load_*`` in metrics.jsonl, ``router_means``). They
are counted with the loss terms switched off too (a fine-tune without the aux loss is where routing can collapse).

Accumulation: a micro-batch's terms are weighted by its share of the step's target tokens, the divisor of the
cross-entropy, so a step of one micro-batch trains exactly transformers' ``loss`` and one of several trains the
target-token-weighted mean of their terms. The logged ``loss`` stays the cross-entropy (comparable with
``eval_loss`` and with dense runs); the terms before their coefficients are logged apart as ``aux_loss`` and
``z_loss``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from ..data.formats import IGNORE
from ..data.loader import Batch
from ..model.moe import routing
from .router_terms import Group, expert_counts, switch_aux, z_loss

AUX, Z, UNITS = "aux_loss", "z_loss", "aux_loss#units"  # window sums: each term x target tokens, and the target tokens
LOAD, LOAD_TOKENS = "expert_load#counts", "expert_load#tokens"  # window sums: (layers, experts) choices, (layers,) tokens


class RouterLoss:
    """The router terms of one model: its kind (``causal``: a decoder-only family's aux function; ``switch``),
    experts, experts per token, and the coefficients of the terms switched on (None: off or not in the family).
    ``sides``: Switch's (encoder, decoder) stacks whose terms transformers adds; ``layers``: the model's routers
    (a micro-batch without router logits counts zeros for each)."""

    def __init__(self, kind: str, num_experts: int, top_k: int, coef: float | None, z_coef: float | None = None,
                 fn: Callable[..., Any] | None = None, sides: tuple[bool, bool] = (True, True), layers: int = 0):
        self.kind, self.num_experts, self.top_k, self.coef, self.z_coef = kind, num_experts, top_k, coef, z_coef
        self.fn, self.sides, self.layers = fn, sides, layers

    def groups(self, routed: dict[str, Any], batch: Batch) -> list[tuple[Group, bool]]:
        """The micro-batch's router groups, each with whether its losses count (Switch: the stacks transformers adds)."""
        if self.kind == "switch":
            encoder = (tuple(routed.get("encoder") or ()), batch.attention_mask)
            decoder = (tuple(routed.get("decoder") or ()), batch.labels != IGNORE)  # a position per target token
            return [(encoder, self.sides[0]), (decoder, self.sides[1])]
        return [((tuple(routed.get("logits") or ()), batch.real), True)]

    def _terms(self, groups: list[tuple[Group, bool]], zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux, z) of a micro-batch with real tokens; zero for a term switched off."""
        counted = [g for g, on in groups if on and g[0]]
        aux = z = zero
        if self.coef is not None and counted:
            if self.kind == "switch":
                aux = sum((switch_aux(g) for g in counted), zero)
            else:
                layers, mask = counted[0]
                out = self.fn(layers, self.num_experts, self.top_k, mask)
                aux = out.float() if torch.is_tensor(out) else zero
        if self.z_coef is not None and counted:
            z = sum((z_loss(g) for g in counted), zero)
        return aux, z

    def add(self, ce_sum: torch.Tensor, routed: dict[str, Any], batch: Batch,
            metrics: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """``ce_sum`` with this micro-batch's router terms in its gradient (its value unchanged); the terms to
        ``metrics``. Every micro-batch adds the same keys (zero without real tokens): data-parallel ranks
        all-reduce the same sums."""
        zero = torch.zeros((), device=ce_sum.device)
        groups = self.groups(routed, batch)
        weight = float(batch.n_targets) if batch.n_tokens and any(g[0] for g, _ in groups) else 0.0
        aux, z = self._terms(groups, zero) if weight else (zero, zero)  # a data-parallel rank's empty share: nothing
        if metrics is not None and (self.coef is not None or self.z_coef is not None):
            for key, value, coef in ((AUX, aux, self.coef), (Z, z, self.z_coef)):
                if coef is not None:
                    metrics[key] = metrics.get(key, 0) + value.detach() * weight
            metrics[UNITS] = metrics.get(UNITS, 0) + torch.tensor(weight, device=ce_sum.device)
        if metrics is not None:
            counted = expert_counts([g for g, _ in groups], self.top_k, self.num_experts) if batch.n_tokens else None
            counts, tokens = counted if counted is not None else (
                torch.zeros(self.layers, self.num_experts, device=zero.device), torch.zeros(self.layers, device=zero.device))
            metrics[LOAD] = metrics.get(LOAD, 0) + counts
            metrics[LOAD_TOKENS] = metrics.get(LOAD_TOKENS, 0) + tokens
        term = ((self.coef or 0.0) * aux + (self.z_coef or 0.0) * z) * weight  # forward_backward divides by the targets
        # the gradient gets the term, the value does not: term - term.detach() is exactly 0, so the summed
        # loss (logged, checked for non-finite values) stays the cross-entropy's
        return ce_sum + (term - term.detach())


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    base = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return base.get_base_model() if hasattr(base, "get_base_model") else base


def _router_count(base: torch.nn.Module) -> int:
    """The modules whose outputs transformers records as ``router_logits`` (one per MoE layer)."""
    classes = set()
    for m in base.modules():
        recorded = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        cls = getattr(recorded, "target_class", recorded)
        if isinstance(cls, type):
            classes.add(cls)
    return sum(isinstance(m, tuple(classes)) for m in base.modules()) if classes else 0


def router_loss_for(model: torch.nn.Module, aux: bool | float = True, z: bool = True) -> RouterLoss | None:
    """The model's router terms (``aux``, ``z``: switched on; off, the expert load is still counted; ``aux`` a number:
    the load-balancing term with that coefficient in place of the config's), or None: a dense model, or a family
    transformers gives no load-balancing function or no recorded router logits (aux-loss-free routing,
    DeepSeek-V3's: its bias-corrected choice is not the top-k of the logits)."""
    base = _unwrapped(model)
    config = getattr(base, "config", None)
    module = sys.modules.get(type(base).__module__)
    if config is None:
        return None
    if getattr(config, "is_encoder_decoder", False) and getattr(module, "router_z_loss_func", None) is not None:
        return _switch(config, aux, z, _router_count(base))
    found = routing(config)
    fn = getattr(module, "load_balancing_loss_func", None)
    records = getattr(base, "_can_record_outputs", None) or {}
    if found is None or fn is None or "router_logits" not in records:
        return None
    text = getattr(config, "text_config", None) or config
    coef = aux_coefficient(aux, getattr(text, "router_aux_loss_coef", None))
    # no decoder-only family of transformers 5 has a z-loss
    return RouterLoss("causal", found[1], found[2], coef, fn=fn, layers=_router_count(base))


def aux_coefficient(aux: bool | float, configured: float | None) -> float | None:
    """The load-balancing term's coefficient: the model config's (``aux`` true; 0 where it has none), the run's own
    (``aux`` a number), or None (``aux`` false: off)."""
    if aux is False:
        return None
    return float(aux) if not isinstance(aux, bool) else float(configured or 0.0)


def _switch(config: Any, aux: bool | float, z: bool, layers: int) -> RouterLoss | None:
    """Switch Transformers' router losses (top-1 routing), with the stacks transformers adds them for."""
    experts = getattr(config, "num_experts", None)
    if not isinstance(experts, int) or experts < 1:
        return None
    sides = (getattr(config, "encoder_sparse_step", 0) > 1, getattr(config, "decoder_sparse_step", 0) > 1)
    coef, z_coef = aux_coefficient(aux, getattr(config, "router_aux_loss_coef", 0.0)), float(getattr(config, "router_z_loss_coef", 0.0))
    return RouterLoss("switch", experts, 1, coef, z_coef if z else None, sides=sides, layers=layers)


def router_means(sums: dict[str, torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:
    """The window's router record (all ranks' sums with ``reduce``, in one call): the target-token-weighted mean of
    each term the run trains (``aux_loss``, ``z_loss``) and the expert load (``load_fields``); empty without a router."""
    keys = [k for k in (AUX, Z) if k in sums]
    parts = [torch.as_tensor(sums[k]).float().reshape(1) for k in (*keys, UNITS)] if keys else []
    load = sums.get(LOAD)
    if load is not None:
        parts += [load.float().flatten(), sums[LOAD_TOKENS].float().flatten()]
    if not parts:
        return {}
    flat = torch.cat([p.to(parts[0].device) for p in parts])
    values = (reduce(flat) if reduce is not None else flat).tolist()
    units = values[len(keys)] if keys else 0.0
    out: dict[str, Any] = {k: (v / units if units else float("nan")) for k, v in zip(keys, values)}
    if load is not None:
        n_layers, experts = load.shape
        start = len(keys) + 1 if keys else 0
        counts = values[start : start + n_layers * experts]
        tokens = values[start + n_layers * experts :]
        out.update(load_fields([counts[i * experts : (i + 1) * experts] for i in range(n_layers)], tokens))
    return out


def load_fields(counts: list[list[float]], tokens: list[float]) -> dict[str, Any]:
    """metrics.jsonl's expert load of a window from each layer's per-expert choices and routed tokens. A share is
    the fraction of a layer's real tokens that chose the expert among their top-k (an even load: top_k / experts;
    at most 1):

    - ``expert_load_max``: the most-loaded expert's share in the worst layer (the console's ``load max``);
    - ``expert_load_min``: the least-loaded expert's share in the layer where it is lowest;
    - ``expert_load_even``: the even share, top_k / experts;
    - ``expert_load_max_by_layer``, ``expert_load_min_by_layer``: each layer's, in the model's router order.

    Empty when no layer routed a token in the window."""
    layers = [(c, n) for c, n in zip(counts, tokens) if n > 0]
    if not layers:
        return {}
    shares = [[x / n for x in c] for c, n in layers]
    top_k = round(sum(layers[0][0]) / layers[0][1])  # every real token makes top_k choices
    highs, lows = [max(s) for s in shares], [min(s) for s in shares]
    return {
        "expert_load_max": max(highs), "expert_load_min": min(lows), "expert_load_even": top_k / len(shares[0]),
        "expert_load_max_by_layer": [round(v, 4) for v in highs], "expert_load_min_by_layer": [round(v, 4) for v in lows],
    }
