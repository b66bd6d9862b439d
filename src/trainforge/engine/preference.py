"""Preference objectives on per-sequence log-probabilities: DPO, IPO, ORPO, SimPO and KTO.

Every function takes the summed log-probabilities of each completion under the policy (and, where
the objective has one, under the reference), with the completion's target-token counts, and returns
the loss of each pair (or, for KTO, each example) unreduced: the step divides the sum by the pairs
of the whole global batch, so accumulation and data parallelism give the loss of one large batch.
The formulas follow the papers; where TRL normalizes differently by default, the docstring says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data.formats import IGNORE
from .loss import fused_head, linear_token_logprobs


@dataclass
class PairLogps:
    """Summed log-probabilities of each pair's chosen and rejected completion, and their target counts."""

    chosen: torch.Tensor  # (P,) policy
    rejected: torch.Tensor  # (P,)
    chosen_tokens: torch.Tensor  # (P,) target tokens of each chosen completion
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None  # (P,) reference, no gradient
    ref_rejected: torch.Tensor | None = None

    def ratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log-ratios policy / reference: the implicit rewards over beta."""
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ValueError("this objective needs the reference model's log-probabilities")
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected


def dpo_loss(p: PairLogps, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)); with
    ``label_smoothing`` eps, the conservative DPO mix (1 - eps) * that + eps * the flipped preference."""
    chosen, rejected = p.ratios()
    margin = beta * (chosen - rejected)
    return -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)


def ipo_loss(p: PairLogps, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): (chosen log-ratio - rejected log-ratio - 1 / (2 beta))^2, the log-ratios
    averaged per target token (as TRL's ``loss_type="ipo"`` does)."""
    chosen, rejected = p.ratios()
    margin = chosen / p.chosen_tokens - rejected / p.rejected_tokens
    return (margin - 1 / (2 * beta)) ** 2


def simpo_loss(p: PairLogps, beta: float, gamma: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024), no reference: -log sigmoid(beta * (mean log p(chosen) - mean log p(rejected)) - gamma)."""
    margin = p.chosen / p.chosen_tokens - p.rejected / p.rejected_tokens
    return -F.logsigmoid(beta * margin - gamma)


def orpo_loss(p: PairLogps, lam: float) -> torch.Tensor:
    """ORPO (Hong et al. 2024), no reference, per pair: the chosen completion's NLL averaged over its tokens,
    plus -lam * log sigmoid(log odds(chosen) - log odds(rejected)).

    The odds of a completion are p / (1 - p) with p its mean per-token probability. The NLL is each pair's own
    token mean (the paper's L_SFT), so the whole loss is per pair: TRL averages the NLL over all chosen tokens of
    the batch instead, which weights long completions more."""
    mean_c, mean_r = p.chosen / p.chosen_tokens, p.rejected / p.rejected_tokens
    # log(1 - exp(x)) for x < 0, stable near 0 (a completion the model already predicts with certainty)
    log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c).clamp(max=1 - 1e-7)) - torch.log1p(-torch.exp(mean_r).clamp(max=1 - 1e-7)))
    return -mean_c - lam * F.logsigmoid(log_odds)


def kto_loss(
    logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
    desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024) per example: ``logps``/``ref_logps`` (N,) summed over each completion,
    ``desirable`` (N,) bool, ``kl`` the batch's reference point (a detached, clamped-at-0 estimate of
    KL(policy || reference) from mismatched prompt/completion pairs). Desirable: w_d * (1 - sigmoid(beta *
    (ratio - kl))); undesirable: w_u * (1 - sigmoid(beta * (kl - ratio)))."""
    ratio = logps - ref_logps
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, good, bad)


def pair_metrics(p: PairLogps, beta: float) -> dict[str, torch.Tensor]:
    """What the field logs per pair (summed by the caller, then divided by the pairs): rewards of chosen
    and rejected (beta x log-ratio, where there is a reference, else beta x mean log-prob), their margin,
    accuracy (chosen rewarded above rejected), and the policy's log-probabilities."""
    if p.ref_chosen is not None and p.ref_rejected is not None:
        chosen, rejected = (beta * r for r in p.ratios())
    else:
        chosen, rejected = beta * p.chosen / p.chosen_tokens, beta * p.rejected / p.rejected_tokens
    return {
        "rewards_chosen": chosen.detach(),
        "rewards_rejected": rejected.detach(),
        "reward_margin": (chosen - rejected).detach(),
        "reward_accuracy": (chosen > rejected).float(),
        "logps_chosen": p.chosen.detach(),
        "logps_rejected": p.rejected.detach(),
    }


def document_index(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, L): the number of the packed document each position belongs to, counted over the whole
    batch in row-major order (a document starts where its position id is 0)."""
    starts = (position_ids == 0).flatten().long()
    return (starts.cumsum(0) - 1).view_as(position_ids)


def sequence_logps(token_logps: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor, n_documents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the target tokens' log-probabilities (``token_logps``: (K,), one per label that is not IGNORE, in
    row-major order, as ``linear_token_logprobs`` returns them) per document: (sums, target counts), (D,) each."""
    kept = labels.flatten() != IGNORE
    doc = documents.flatten()[kept]
    sums = torch.zeros(n_documents, device=token_logps.device, dtype=token_logps.dtype).index_add(0, doc, token_logps)
    counts = torch.zeros(n_documents, device=token_logps.device, dtype=torch.long).index_add(0, doc, torch.ones_like(doc))
    return sums, counts


def batch_pair_logps(model: torch.nn.Module, batch, precision, fused: bool = True) -> PairLogps:
    """The policy's summed log-probabilities of every pair in a collated batch of ``pair_rows`` rows (each
    pair's chosen and rejected documents in order): one forward, through the chunked fused head (no logits)
    where the model allows and ``fused``, else the model's own logits (a DDP wrapper, LoRA on the head)."""
    head = fused_head(model) if fused else None
    with precision.autocast(batch.input_ids.device):
        if head is not None:
            decoder, lm_head = head
            hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).last_hidden_state
            token_logps = linear_token_logprobs(hidden.flatten(0, 1), lm_head, batch.labels.flatten())
        else:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
            labels = batch.labels.flatten()
            kept = labels != IGNORE
            token_logps = -F.cross_entropy(logits.flatten(0, 1)[kept].float(), labels[kept], reduction="none")
    # sizes from the host's counts, not read from the device: the real documents, plus at most one padding tail
    # per row (a document of its own, with no targets), which nonzero_static leaves out at a known size
    docs = document_index(batch.position_ids)
    sums, counts = sequence_logps(token_logps, batch.labels, docs, batch.n_documents + batch.input_ids.shape[0])
    real = torch.nonzero_static(counts > 0, size=batch.n_documents).squeeze(1)
    sums, counts = sums[real].view(-1, 2), counts[real].view(-1, 2)
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1])


@torch.no_grad()
def reference_pair_logps(
    model: torch.nn.Module, batch, precision, reference: torch.nn.Module | None = None, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities under the reference: ``reference`` when given (a frozen
    copy of the starting weights), else ``model`` with its LoRA adapters switched off (no second copy)."""
    if reference is not None:
        p = batch_pair_logps(reference, batch, precision, fused)
    else:
        with model.disable_adapter():
            p = batch_pair_logps(model, batch, precision, fused)
    return p.chosen.detach(), p.rejected.detach()
