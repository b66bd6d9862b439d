"""What a step minimizes, and what it divides by: ``train.objective``.

``TokenObjective`` (sft, engine/step.py): the summed next-token cross-entropy, divided by the step's target tokens.
``PairObjective`` (dpo, ipo, orpo, simpo): the summed per-pair loss of engine/preference.py, divided by the
step's pairs; kto: per example, each packed as a pair with its KL sample, divided by the step's examples.
Either way the divisor counts the whole global batch (all micro-batches, all processes), so accumulation and
data parallelism give the gradient of one large batch. A pair objective also adds its metrics (rewards, margin,
accuracy, log-probabilities) to a ``metrics`` dict of device sums, read at log steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..config.preference import REFERENCE_FREE, run_reference
from ..data.loader import Batch
from ..hardware.device import Precision
from . import preference as pref
from .loss import fused_head
from .grpo import GRPOObjective
from .router_loss import router_loss_for
from .step import TokenObjective

PAIRS = "pairs"  # the key of a metrics dict that counts the pairs its sums are over
COUNT = "n:"  # a metrics key "n:NAME" counts what the sum NAME is over, where that is not every pair
TIE = 1e-6  # a KTO reward this close to the reference point (beta x KL) is on neither side of it


class PairObjective:
    """A preference objective over batches of packed pairs (``data/packing.pair_rows``).

    ``reference``: ``adapters`` (the policy with its LoRA adapters off), ``model`` (``reference_model``, a frozen
    copy of the starting weights), ``precompute`` (each batch carries them: engine/reference.py), or ``none``
    (log-ratios against 0; orpo and simpo never read one)."""

    unit = "pair"

    def __init__(self, name: str, settings: Any, reference: str, reference_model: torch.nn.Module | None = None):
        self.name, self.s, self.reference, self.reference_model = name, settings, reference, reference_model
        self.prepared: list[tuple[torch.Tensor, torch.Tensor]] = []  # kto: the step's reference log-probabilities
        self.prepared_policy: list[pref.PairLogps] = []  # kto, evaluating: the policy's, computed once
        self.kl: torch.Tensor | None = None  # kto: the step's reference point

    def begin_step(self, model: torch.nn.Module, micro_batches, precision: Precision, device: torch.device, fused: bool = True,
                   counted: list[bool] | None = None) -> None:
        """KTO: the step's reference point before any of its losses, from every micro-batch of every process (so
        accumulation and data parallelism give one large batch's): KL(policy || reference) estimated on the KL
        samples, mean log-ratio clamped at 0, no gradient. The reference log-probabilities it needs are kept
        for the micro-batches' losses. Other objectives need nothing before a step.

        An evaluation begins alike over all its batches (``counted``: which of them count; a process short of one
        repeats a batch), so its reference point does not depend on the micro-batch or the process count; the
        policy's log-probabilities are kept too, as nothing trains between this and the losses."""
        if self.name != "kto":
            return
        model = _unwrapped(model)
        fused = fused and fused_head(model) is not None
        self.prepared, self.prepared_policy, total = [], [], torch.zeros(2, device=device)
        with torch.no_grad():
            for k, mb in enumerate(micro_batches):
                mb = mb.to(device)
                policy = pref.batch_pair_logps(model, mb, precision, fused)
                ref = self._reference(model, mb, precision, fused)
                self.prepared.append(ref)
                if counted is not None:
                    self.prepared_policy.append(policy)
                if counted is None or counted[k]:
                    total += torch.stack([(policy.rejected - ref[1]).sum(), torch.tensor(float(len(ref[1])), device=device)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        self.kl = (total[0] / total[1].clamp(min=1)).clamp(min=0)

    def _reference(self, model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference == "precompute":
            if batch.reference is None:
                raise ValueError("preference.reference precompute: this batch carries no reference log-probabilities")
            ref = batch.reference.to(batch.input_ids.device)
            return ref[:, 0], ref[:, 1]
        base = self.reference_model if self.reference == "model" else None
        return pref.reference_pair_logps(_unwrapped(model), batch, precision, base, fused)

    def units(self, batch: Batch) -> int:
        return batch.n_documents // 2  # chosen and rejected are a document each

    def loss_sum(self, model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool = True,
                 metrics: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The sum of the batch's per-pair losses (fp32); its pairs' metrics added to ``metrics``."""
        # policy and reference through the same head: the fused one, unless the policy's forward cannot take it
        # (a DDP wrapper, LoRA on the head); at the first step the two are then equal to the bit, every reward 0
        fused = fused and fused_head(model) is not None
        p = self.prepared_policy.pop(0) if self.prepared_policy else pref.batch_pair_logps(model, batch, precision, fused)
        if self.name == "kto":
            return self._kto_sum(model, batch, precision, fused, p, metrics)
        if self.reference != "none":
            p.ref_chosen, p.ref_rejected = self._reference(model, batch, precision, fused)
        elif self.name not in REFERENCE_FREE:  # reference-free DPO / IPO: the log-ratios are the log-probabilities
            p.ref_chosen, p.ref_rejected = torch.zeros_like(p.chosen), torch.zeros_like(p.rejected)
        losses = self.pair_losses(p)
        if metrics is not None:
            sums = {k: v.float().sum() for k, v in pref.pair_metrics(p, self.s.beta).items()}
            _add(metrics, {**sums, PAIRS: torch.tensor(float(len(losses)), device=losses.device)})
        return losses.sum()

    def _kto_sum(self, model, batch: Batch, precision: Precision, fused: bool, p: pref.PairLogps, metrics) -> torch.Tensor:
        """KTO's summed per-example loss: ``p.chosen`` the examples, ``p.rejected`` their KL samples. The reference
        point is the step's or the evaluation's (``begin_step``); without one, this batch's own estimate."""
        if self.prepared:
            (ref, ref_kl), kl = self.prepared.pop(0), self.kl
        else:
            ref, ref_kl = self._reference(model, batch, precision, fused)
            kl = (p.rejected.detach() - ref_kl).mean().clamp(min=0) if len(ref_kl) else torch.zeros((), device=ref.device)
        good = batch.desirable.to(ref.device)
        s = self.s
        losses = pref.kto_loss(p.chosen, ref, good, kl, s.beta, s.desirable_weight, s.undesirable_weight)
        if metrics is not None:
            with torch.no_grad():
                rewards = s.beta * (p.chosen.detach() - ref)
                margin = rewards - s.beta * kl  # above 0: on the desirable side of the reference point
                sums = {
                    "rewards_desirable": (rewards * good).sum(), COUNT + "rewards_desirable": good.sum().float(),
                    "rewards_undesirable": (rewards * ~good).sum(), COUNT + "rewards_undesirable": (~good).sum().float(),
                    # the sign of reward - beta x KL against the label: what KTO learns to get right (a tie is on
                    # neither side: before the first step every reward is the reference point, the accuracy 0, as DPO's;
                    # "tie" within TIE: the KL all-reduced over ranks differs from one process's in its last bits)
                    "reward_accuracy": torch.where(good, margin > TIE, margin < -TIE).float().sum(),
                    "kl": kl * len(losses), "logps": p.chosen.detach().sum(), PAIRS: torch.tensor(float(len(losses)), device=ref.device),
                }
                _add(metrics, sums)
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


def _add(metrics: dict[str, torch.Tensor], sums: dict[str, torch.Tensor]) -> None:
    """Add a batch's metric sums into ``metrics`` (device tensors, nothing read)."""
    for key, value in sums.items():
        metrics[key] = metrics.get(key, 0) + value


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a DDP wrapper: no-gradient passes need no gradient exchange, and the adapters live there."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def build_objective(cfg, model: torch.nn.Module) -> TokenObjective | PairObjective | GRPOObjective:
    """The run's objective; a full fine-tune's reference is a frozen copy of ``model`` as it is now (call it
    before a checkpoint is loaded: the reference is the starting weights, on a resume too)."""
    name = cfg.train.objective
    if name == "sft":
        return TokenObjective(router_loss_for(model, cfg.model.router_aux_loss, cfg.model.router_z_loss))
    reference = run_reference(cfg)  # grpo: beta > 0, the reference of DPO (adapters off, or a frozen copy); 0: none runs
    if name == "grpo":
        return GRPOObjective(cfg.rl, reference, _frozen(model) if reference == "model" else None)
    return PairObjective(name, cfg.preference, reference, _frozen(model) if reference == "model" else None)


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` as it is now: a full fine-tune's reference."""
    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


def describe_objective(objective: PairObjective, desirable=None) -> str:
    """The console line saying what a preference run optimizes and what its reference is; for KTO, with
    ``desirable`` (the train store's label per sequence, two sequences an example), how many of each and
    the weights that balance them when these do not."""
    s = objective.s
    knobs = {"dpo": f"beta {s.beta}" + (f", label smoothing {s.label_smoothing}" if s.label_smoothing else ""),
             "kto": f"beta {s.beta}, weights {s.desirable_weight} desirable / {s.undesirable_weight} undesirable",
             "ipo": f"tau {s.beta}", "simpo": f"beta {s.beta}, gamma {s.simpo_gamma}", "orpo": f"lambda {s.beta}"}
    reference = {"adapters": "the same model with its LoRA adapters off", "model": "a frozen copy of the starting weights",
                 "precompute": "the starting weights' log-probabilities, precomputed once",
                 "none": "none" + (" (reference-free)" if objective.name not in REFERENCE_FREE else "")}
    line = f"objective: {objective.name} ({knobs[objective.name]}), reference: {reference[objective.reference]}"
    return line + (kto_balance(s, desirable) if objective.name == "kto" and desirable is not None else "")


def kto_balance(s, desirable) -> str:
    """The train examples of each label, and, when desirable_weight x desirable / (undesirable_weight x undesirable)
    is outside 1 to 4/3 (the KTO paper's range, which TRL's KTOTrainer warns about), weights that bring it there."""
    good = int(desirable.sum()) // 2
    bad = len(desirable) // 2 - good
    line = f"; train examples: {good:,} desirable, {bad:,} undesirable"
    if not good or not bad:
        return line + " (one label only: the KTO paper trains on both)"
    ratio = s.desirable_weight * good / (s.undesirable_weight * bad)
    if 1.0 <= ratio <= 4 / 3:
        return line
    lo, hi = s.undesirable_weight * bad / good, s.undesirable_weight * bad * 4 / (3 * good)
    return (line + f" (weighted {ratio:.2f} to 1; the KTO paper keeps this within 1 to 4/3: set preference.desirable_weight "
            f"to {lo:.2f}-{hi:.2f}, or preference.undesirable_weight to {s.desirable_weight * good * 3 / (4 * bad):.2f}-"
            f"{s.desirable_weight * good / bad:.2f})")


def mean_metrics(sums: dict[str, torch.Tensor], prefix: str = "", reduce=None) -> dict[str, float]:
    """Per-pair means of a metrics dict of sums (one host read); empty without pairs. ``reduce``: sums the
    stacked sums over processes (``DistContext.all_reduce``): every rank calls it with the same keys."""
    if PAIRS not in sums:
        return {}
    keys = list(sums)
    stacked = torch.stack([torch.as_tensor(sums[k]).float().reshape(()) for k in keys])
    total = dict(zip(keys, (reduce(stacked) if reduce is not None else stacked).tolist()))
    return {prefix + k: v / max(total.get(COUNT + k, total[PAIRS]), 1.0) for k, v in total.items()
            if k != PAIRS and not k.startswith(COUNT)}
