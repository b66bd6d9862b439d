"""One optimizer step: token-normalized loss over all its micro-batches, backward, clip, update."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..data.formats import IGNORE
from ..data.loader import Batch
from ..hardware.device import Precision
from ..metrics.by_source import add_by_source, source_sums
from ..metrics.profile import NULL_TIMER, StepTimer
from .loss import fused_head, linear_cross_entropy, seq2seq_fused_head
from .nonfinite import skip_update_if
from .optim import clip_gradients


def loss_sum(model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool = True,
             routed: dict | None = None, by_source: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the batch's target tokens, in fp32.

    ``fused``: through the chunked LM-head + cross-entropy (no full logits) where the model allows.
    Encoder-decoder batches (``decoder_input_ids`` set): cross-entropy of the decoder's predictions of the target.
    ``routed``: a mixture-of-experts model's router logits of each layer go there (``logits``; an encoder-decoder's
    ``encoder`` and ``decoder``).
    ``by_source``: a mixture's batch (``source_ids``) adds its loss and target count per source there, on the
    device (``SOURCE_SUMS``: metrics/by_source.py reads it at log steps).
    """
    if batch.decoder_input_ids is not None:
        return seq2seq_loss_sum(model, batch, precision, fused, routed)
    head = fused_head(model) if fused else None
    sums = source_sums(by_source, batch)
    groups = batch.source_ids.flatten() if sums is not None else None
    # use_cache=False: a KV cache is useless here, and with one transformers skips the
    # packed-document mask built from position_ids (documents would attend to each other)
    extra = {"output_router_logits": True} if routed is not None else {}
    with precision.autocast(batch.input_ids.device):
        if head is not None:
            decoder, lm_head = head
            out = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **extra)
            if routed is not None:
                routed["logits"] = out.router_logits
            return linear_cross_entropy(out.last_hidden_state.flatten(0, 1), lm_head, batch.labels.flatten(), None, groups, sums)
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **extra)
        if routed is not None:
            routed["logits"] = out.router_logits
    if sums is None:
        return F.cross_entropy(out.logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE, reduction="sum")
    losses = F.cross_entropy(out.logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE, reduction="none")
    add_by_source(sums, groups, losses.detach(), batch.labels.flatten() != IGNORE)
    return losses.sum()


class TokenObjective:
    """Next-token cross-entropy over the learned tokens (``train.objective: sft``), divided by the step's target
    tokens; the preference objectives (engine/objective.py) answer the same three calls."""

    name, unit, reference = "sft", "token", "none"

    def __init__(self, router: Any = None):
        self.router = router  # a mixture-of-experts model's load-balancing loss (engine/router_loss.py), or None

    def units(self, batch: Batch) -> int:
        return batch.n_targets

    def begin_step(self, *args: Any) -> None:
        """Nothing to prepare before a step's micro-batches."""

    def loss_sum(self, model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool = True,
                 metrics: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        routed: dict | None = {} if self.router is not None and torch.is_grad_enabled() else None
        by_source = metrics if batch.source_ids is not None else None  # a mixture: its loss per source to the metrics
        if routed is None and by_source is None:
            return loss_sum(model, batch, precision, fused)  # this module's loss_sum, looked up at each call
        total = loss_sum(model, batch, precision, fused, routed, by_source)
        return total if routed is None else self.router.add(total, routed, batch, metrics)


TOKENS = TokenObjective()


def seq2seq_loss_sum(model: torch.nn.Module, batch: Batch, precision: Precision, fused: bool = True,
                     routed: dict | None = None) -> torch.Tensor:
    """``loss_sum`` of an encoder-decoder: the encoder reads the source (padding masked), the decoder
    its shifted target; summed over target tokens, in fp32. ``fused``: the chunked head where
    ``seq2seq_fused_head`` knows how the model computes its logits, else the model's own head.
    ``routed``: a mixture-of-experts encoder-decoder's (Switch Transformers') router logits of each stack go there."""
    head = seq2seq_fused_head(model) if fused and routed is None else None
    with precision.autocast(batch.input_ids.device):
        if head is not None:
            hidden, lm_head, bias = head(batch.input_ids, batch.attention_mask, batch.decoder_input_ids)
            return linear_cross_entropy(hidden.flatten(0, 1), lm_head, batch.labels.flatten(), bias)
        extra = {"output_router_logits": True} if routed is not None else {}
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, decoder_input_ids=batch.decoder_input_ids,
            use_cache=False, **extra,
        )
        if routed is not None:
            routed["encoder"], routed["decoder"] = out.encoder_router_logits, out.decoder_router_logits
    return F.cross_entropy(out.logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE, reduction="sum")


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Sequence[Batch],
    precision: Precision,
    device: torch.device,
    scaler: torch.amp.GradScaler | None = None,
    n_targets: int | None = None,
    sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    timer: StepTimer = NULL_TIMER,
    fused: bool = True,
    objective: Any = TOKENS,
    metrics: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Accumulate gradients of (sum of all target-token losses) / (number of target tokens).

    ``objective``: what is summed and counted (``TokenObjective``, or engine/objective.py's per-pair preference
    losses over pairs: ``n_targets`` is then the step's count of its units); its metrics' sums go to ``metrics``.

    The divisor counts every target token of every micro-batch of the step, so 4 x 1 and
    1 x 4 micro-batching give the same gradient (a mean of per-micro-batch means would not).
    Data-parallel: ``n_targets`` is the count over all ranks, and ``sync(last)`` is the context
    of each backward (gradients are exchanged on the last micro-batch only).
    ``fused``: the chunked LM-head + cross-entropy where the model allows (see ``loss_sum``).
    Returns this process's share of the step's mean loss as a device tensor: reading it is left to log steps.
    """
    if n_targets is None:  # counted on the host: no device sync
        n_targets = sum(objective.units(mb) for mb in micro_batches)
    total = torch.zeros((), device=device)
    objective.begin_step(model, micro_batches, precision, device, fused)  # e.g. KTO's reference point over the whole step
    for i, mb in enumerate(micro_batches):
        mb = mb.to(device)
        with sync(i == len(micro_batches) - 1) if sync is not None else contextlib.nullcontext():
            with timer.phase("forward"):
                summed = objective.loss_sum(model, mb, precision, fused, metrics)
            scaled = summed / n_targets
            with timer.phase("backward"):
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total += summed.detach()
    return total / n_targets


def optimizer_step(
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    scaler: torch.amp.GradScaler | None = None,
    loss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip (after unscaling fp16 grads), step unless the loss or grad norm is not finite, clear grads.

    Returns (pre-clip grad norm, skipped) as device tensors: nothing here waits for the device.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = clip_gradients(params, optimizer, max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor; the skip test wants a plain tensor
        grad_norm = grad_norm.full_tensor()
    bad = ~torch.isfinite(loss) if loss is not None else torch.zeros((), dtype=torch.bool, device=grad_norm.device)
    if scaler is not None:
        # an fp16 gradient overflow is the scaler's business: it skips that update and lowers the scale
        scaler.step(optimizer)
        scaler.update()
    else:
        bad = bad | ~torch.isfinite(grad_norm)
        skip_update_if(optimizer, bad)
    optimizer.zero_grad(set_to_none=True)  # frees grad memory instead of writing zeros
    return grad_norm, bad
