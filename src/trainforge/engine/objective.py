"""What a step minimizes, and what it divides by: ``train.objective``.

``TokenObjective`` (sft): the summed next-token cross-entropy, divided by the step's target tokens.
``PairObjective`` (dpo, ipo, orpo, simpo): the summed per-pair loss of engine/preference.py, divided by the
step's pairs. Either way the divisor counts the whole global batch (all micro-batches, all processes), so
accumulation and data parallelism give the gradient of one large batch. A pair objective also adds its
metrics (rewards, margin, accuracy, log-probabilities) to a ``metrics`` dict of device sums, read at log steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..config_preference import REFERENCE_FREE
from ..data.loader import Batch
from ..hardware import Precision
from . import preference as pref
from .loss import fused_head
from .step import loss_sum

PAIRS = "pairs"  # the key of a metrics dict that counts the pairs its sums are over


class TokenObjective:
    """Next-token cross-entropy over the learned tokens (``train.objective: sft``)."""

    name, unit, reference = "sft", "token", "none"

    def units(self, batch: Batch) -> int:
        return batch.n_targets

    def loss_sum(self, model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool = True,
                 metrics: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        return loss_sum(model, batch, precision, fused)


class PairObjective:
    """A preference objective over batches of packed pairs (``data/packing.pair_rows``).

    ``reference``: ``adapters`` (the policy with its LoRA adapters off), ``model`` (``reference_model``, a frozen
    copy of the starting weights), or ``none`` (log-ratios against 0; orpo and simpo never read one)."""

    unit = "pair"

    def __init__(self, name: str, settings: Any, reference: str, reference_model: torch.nn.Module | None = None):
        self.name, self.s, self.reference, self.reference_model = name, settings, reference, reference_model

    def units(self, batch: Batch) -> int:
        return batch.n_documents // 2  # chosen and rejected are a document each

    def loss_sum(self, model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool = True,
                 metrics: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The sum of the batch's per-pair losses (fp32); its pairs' metrics added to ``metrics``."""
        # policy and reference through the same head: the fused one, unless the policy's forward cannot take it
        # (a DDP wrapper, LoRA on the head); at the first step the two are then equal to the bit, every reward 0
        fused = fused and fused_head(model) is not None
        p = pref.batch_pair_logps(model, batch, precision, fused)
        if self.reference != "none":
            base = self.reference_model if self.reference == "model" else None
            # DDP: the wrapped model (the reference forward needs no gradient exchange, and has the adapters)
            unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            p.ref_chosen, p.ref_rejected = pref.reference_pair_logps(unwrapped, batch, precision, base, fused)
        elif self.name not in REFERENCE_FREE:  # reference-free DPO / IPO: the log-ratios are the log-probabilities
            p.ref_chosen, p.ref_rejected = torch.zeros_like(p.chosen), torch.zeros_like(p.rejected)
        losses = self.pair_losses(p)
        if metrics is not None:
            with torch.no_grad():
                for key, value in pref.pair_metrics(p, self.s.beta).items():
                    metrics[key] = metrics.get(key, 0) + value.float().sum()
                metrics[PAIRS] = metrics.get(PAIRS, 0) + torch.tensor(float(len(losses)), device=losses.device)
        return losses.sum()

    def pair_losses(self, p: pref.PairLogps) -> torch.Tensor:
        s = self.s
        if self.name == "dpo":
            return pref.dpo_loss(p, s.beta, s.label_smoothing)
        if self.name == "ipo":
            return pref.ipo_loss(p, s.beta)
        if self.name == "simpo":
            return pref.simpo_loss(p, s.beta, s.simpo_gamma)
        return pref.orpo_loss(p, s.beta)


def resolve_reference(objective: str, reference: str, method: str) -> str:
    """What gives the reference log-probabilities: ``adapters``, ``model`` or ``none`` (preference.reference)."""
    if objective in REFERENCE_FREE or reference == "none":
        return "none"
    if reference == "auto":
        return "adapters" if method in ("lora", "qlora") else "model"
    return "model"


def build_objective(cfg, model: torch.nn.Module) -> TokenObjective | PairObjective:
    """The run's objective; a full fine-tune's reference is a frozen copy of ``model`` as it is now (call it
    before a checkpoint is loaded: the reference is the starting weights, on a resume too)."""
    name = cfg.train.objective
    if name == "sft":
        return TokenObjective()
    reference = resolve_reference(name, cfg.preference.reference, cfg.model.method)
    frozen = None
    if reference == "model":
        frozen = copy.deepcopy(model).eval()
        frozen.requires_grad_(False)
    return PairObjective(name, cfg.preference, reference, frozen)


def describe_objective(objective: PairObjective) -> str:
    """The console line saying what a preference run optimizes and what its reference is."""
    s = objective.s
    knobs = {"dpo": f"beta {s.beta}" + (f", label smoothing {s.label_smoothing}" if s.label_smoothing else ""),
             "ipo": f"tau {s.beta}", "simpo": f"beta {s.beta}, gamma {s.simpo_gamma}", "orpo": f"lambda {s.beta}"}
    reference = {"adapters": "the same model with its LoRA adapters off", "model": "a frozen copy of the starting weights",
                 "none": "none" + (" (reference-free)" if objective.name not in REFERENCE_FREE else "")}
    return f"objective: {objective.name} ({knobs[objective.name]}), reference: {reference[objective.reference]}"


def mean_metrics(sums: dict[str, torch.Tensor], prefix: str = "", reduce=None) -> dict[str, float]:
    """Per-pair means of a metrics dict of sums (one host read); empty without pairs. ``reduce``: sums the
    stacked sums over processes (``DistContext.all_reduce``): every rank calls it with the same keys."""
    if PAIRS not in sums:
        return {}
    keys = [k for k in sums if k != PAIRS]
    stacked = torch.stack([sums[k].float() for k in keys] + [sums[PAIRS].float()])
    values = (reduce(stacked) if reduce is not None else stacked).tolist()
    n = max(values[-1], 1.0)
    return {prefix + k: v / n for k, v in zip(keys, values[:-1])}
