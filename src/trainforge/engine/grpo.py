"""GRPO and its variants (Dr. GRPO, DAPO, GSPO) on packed prompt + completion documents: ``train.objective: grpo``.

A rollout batch (rl/stage.py) packs each completion behind its prompt as one document whose only targets are the
completion's tokens, with the completion's advantage, and, where they are needed, the per-token log-probabilities
recorded when it was generated (``num_iterations`` > 1) and under the reference (``beta`` > 0). The policy's
log-probabilities come from the chunked fused head (engine/loss.py), at the sampling temperature.

Each loss is a sum here; the step divides it by ``units`` counted over the whole step (all micro-batches, all
processes), so accumulation and data parallelism give the loss of one large batch:

- grpo: per completion, the mean of its token terms; divided by the completions (TRL's ``loss_type="grpo"``);
- dr_grpo: the sum of all token terms, divided by max_completion_length x completions (Liu et al. 2025);
- dapo: the sum of all token terms, divided by the step's completion tokens (Yu et al. 2025), clip-higher;
- gspo: one ratio per completion, exp(mean token log-ratio), its clipped term plus the mean token KL, divided by
  the completions (Zheng et al. 2025).

A token term is -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta x KL, with r = pi / pi_old and the
k3 estimator KL = exp(ref - logp) - (ref - logp) - 1 (Schulman 2020), as TRL's GRPOTrainer defines them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..data.formats import IGNORE
from ..data.loader import Batch
from ..hardware.device import Precision
from .loss import fused_head, linear_token_logprobs

SEQUENCES = "pairs"  # the metrics key counting what the sums are over (engine/objective.py's PAIRS): completions
COUNT = "n:"  # "n:NAME": what the sum NAME is over, where that is not every completion (engine/objective.py)


@dataclass
class RolloutBatch(Batch):
    """A micro-batch of packed prompt + completion documents (``Batch``) with what GRPO learns from; every
    per-token tensor is (K,), one per target token in row-major order, as ``linear_token_logprobs`` returns them."""

    token_seq: torch.Tensor | None = None  # (K,) the completion (0..S-1 in this batch) each target belongs to
    advantages: torch.Tensor | None = None  # (S,) per completion
    seq_tokens: torch.Tensor | None = None  # (S,) target tokens per completion (0 for a masked one)
    old_logps: torch.Tensor | None = None  # (K,) recorded at generation: num_iterations > 1
    ref_logps: torch.Tensor | None = None  # (K,) the reference's: beta > 0
    n_sequences: int = 0  # completions S (a masked, truncated one too: it counts, with no targets)
    host_sums: dict[str, float] | None = None  # rewards, lengths, generation seconds: summed on the host

    def _map(self, fn) -> "RolloutBatch":
        t = lambda x: fn(x) if x is not None else None  # noqa: E731
        base = super()._map(fn)
        return RolloutBatch(
            base.input_ids, base.labels, base.position_ids, base.n_tokens, base.n_targets, base.indices,
            n_documents=base.n_documents, token_seq=t(self.token_seq), advantages=t(self.advantages),
            seq_tokens=t(self.seq_tokens), old_logps=t(self.old_logps), ref_logps=t(self.ref_logps),
            n_sequences=self.n_sequences, host_sums=self.host_sums,
        )


def token_logps(model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool, temperature: float) -> torch.Tensor:
    """log pi(token) of every target token of ``batch`` (K,), fp32, under the policy's logits / ``temperature``:
    through the chunked fused head where ``fused`` and the model allow (the hidden states divided by the
    temperature: the head is linear), else the model's own logits."""
    head = fused_head(model) if fused else None
    with precision.autocast(batch.input_ids.device):
        if head is not None:
            decoder, lm_head = head
            hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).last_hidden_state
            hidden = hidden.flatten(0, 1)
            bias = lm_head.bias / temperature if lm_head.bias is not None else None
            return linear_token_logprobs(hidden / temperature if temperature != 1 else hidden, lm_head,
                                         batch.labels.flatten(), bias)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    labels = batch.labels.flatten()
    kept = labels != IGNORE
    return -F.cross_entropy(logits.flatten(0, 1)[kept].float() / temperature, labels[kept], reduction="none")


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1, >= 0."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def segment_sum(values: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of ``values`` (K,) per completion ``seq`` (K,) into (n,)."""
    return torch.zeros(n, device=values.device, dtype=values.dtype).index_add(0, seq, values)


@dataclass
class Terms:
    """A batch's loss sum and its metric sums (device tensors)."""

    loss: torch.Tensor
    kl_sum: torch.Tensor | None
    clipped: torch.Tensor  # tokens (gspo: completions) where the clipped term was taken
    clip_count: torch.Tensor  # what ``clipped`` counts over


def grpo_terms(logps: torch.Tensor, batch: RolloutBatch, s: Any) -> Terms:
    """The summed loss of one rollout batch under ``s`` (RLSettings), from the policy's ``logps`` (K,)."""
    seq, n = batch.token_seq, batch.n_sequences
    counts = batch.seq_tokens.to(logps.dtype)
    old = batch.old_logps if batch.old_logps is not None else logps.detach()  # one iteration: r = 1, its gradient
    log_ratio = logps - old
    low, high = 1 - s.epsilon, 1 + s.clip_high
    kl = k3_kl(logps, batch.ref_logps) if s.beta > 0 and batch.ref_logps is not None else None
    adv = batch.advantages.to(logps.dtype)
    if s.loss == "gspo":  # one ratio per completion: the geometric mean of its token ratios
        ratio = torch.exp(segment_sum(log_ratio, seq, n) / counts.clamp(min=1))
        has = counts > 0
        term = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        if kl is not None:
            term = term + s.beta * segment_sum(kl, seq, n) / counts.clamp(min=1)
        clipped = _clipped(ratio, adv, low, high) & has
        return Terms((term * has).sum(), kl.sum() if kl is not None else None, clipped.sum().float(), has.sum().float())
    ratio = torch.exp(log_ratio)
    a = adv[seq]
    term = -torch.minimum(ratio * a, ratio.clamp(low, high) * a)
    if kl is not None:
        term = term + s.beta * kl
    clipped = _clipped(ratio, a, low, high)
    if s.loss == "grpo":  # each completion's token mean
        loss = (segment_sum(term, seq, n) / counts.clamp(min=1)).sum()
    else:  # dr_grpo, dapo: the token sum (their divisors differ: ``GRPOObjective.units``)
        loss = term.sum()
    return Terms(loss, kl.sum() if kl is not None else None, clipped.sum().float(), torch.tensor(float(len(term)), device=term.device))


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where min() takes the clipped term and its gradient is 0: the ratio past the range on the side the advantage
    pushes it (below with A < 0, above with A > 0)."""
    return ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))


class GRPOObjective:
    """``train.objective: grpo``: the step's batches come from the rollout stage (rl/stage.py), which also records
    the rollout's and the reference's log-probabilities; here the policy's are taken and the loss summed."""

    name, unit = "grpo", "completion"

    def __init__(self, settings: Any, reference: str, reference_model: torch.nn.Module | None = None):
        self.s, self.reference, self.reference_model = settings, reference, reference_model

    def units(self, batch: RolloutBatch) -> int:
        if self.s.loss == "dapo":
            return batch.n_targets
        if self.s.loss == "dr_grpo":
            return batch.n_sequences * self.s.max_completion_length
        return batch.n_sequences

    def begin_step(self, *args: Any) -> None:
        """Nothing: the rollout stage prepared the step's batches."""

    def loss_sum(self, model: torch.nn.Module, batch: RolloutBatch, precision: Precision, fused: bool = True,
                 metrics: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        logps = token_logps(model, batch, precision, fused and fused_head(model) is not None, self.s.temperature)
        terms = grpo_terms(logps, batch, self.s)
        if metrics is not None:
            device = logps.device
            sums = {k: torch.tensor(v, device=device) for k, v in (batch.host_sums or {}).items()}
            sums["clip_ratio"], sums[COUNT + "clip_ratio"] = terms.clipped, terms.clip_count
            if terms.kl_sum is not None:
                sums["kl"], sums[COUNT + "kl"] = terms.kl_sum.detach(), torch.tensor(float(len(logps)), device=device)
            for key, value in sums.items():
                metrics[key] = metrics.get(key, 0) + value
        return terms.loss

    @torch.no_grad()
    def reference_logps(self, model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool) -> torch.Tensor:
        """The reference's per-token log-probabilities of ``batch``: LoRA's adapters off, or the frozen copy."""
        if self.reference == "model":
            return token_logps(self.reference_model, batch, precision, fused, self.s.temperature)
        with model.disable_adapter():
            return token_logps(model, batch, precision, fused, self.s.temperature)
