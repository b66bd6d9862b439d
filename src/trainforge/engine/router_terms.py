"""Router terms of a mixture-of-experts micro-batch over its real tokens, on the device (no host sync).

- ``z_loss``: transformers' ``router_z_loss_func`` (Switch Transformers; ST-MoE's z-loss): the mean over the
  routers' tokens of ``logsumexp(router logits)^2``. transformers concatenates a stack's layers along the token
  axis and takes one mean; here the same mean skips padding.
- ``switch_aux``: Switch Transformers' ``load_balancing_loss_func`` (top-1: per row, the share of tokens sent
  to each expert times the mean router probability of that expert, x experts^2, averaged over rows and experts),
  each row's means over its real tokens.
- ``expert_counts``: per layer, how many real tokens chose each expert among their top-k (the expert-load
  metrics: ``router_loss.py`` sums them over the log window).

A group is one stack's routers: each layer's logits (``(tokens, experts)`` or ``(rows, length, experts)``) and
the ``(rows, length)`` mask of the real tokens they routed (None: all real).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Group = tuple[Sequence[torch.Tensor], torch.Tensor | None]


def _flat_mask(layer: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The real-token mask of one layer's logits as a float vector over its tokens."""
    tokens = layer.numel() // layer.shape[-1]
    if mask is None:
        return torch.ones(tokens, dtype=torch.float32, device=layer.device)
    return mask.reshape(-1).to(device=layer.device, dtype=torch.float32)


def z_loss(group: Group) -> torch.Tensor:
    """Mean of ``logsumexp(logits)^2`` over the group's layers and real tokens (0 without real tokens)."""
    layers, mask = group
    m = _flat_mask(layers[0], mask)
    total = sum((torch.logsumexp(lay.reshape(-1, lay.shape[-1]).float(), dim=-1).pow(2) * m).sum() for lay in layers)
    return total / (m.sum() * len(layers)).clamp(min=1.0)


def switch_aux(group: Group) -> torch.Tensor:
    """Switch Transformers' load-balancing loss of one stack over its real tokens: transformers' value where
    every token is real (rows without a real token are left out of the mean over rows)."""
    layers, mask = group
    logits = torch.cat([lay.float() for lay in layers], dim=1)  # (rows, layers x length, experts), as transformers
    experts = logits.shape[-1]
    m = (torch.ones(logits.shape[:2], device=logits.device) if mask is None
         else mask.to(device=logits.device, dtype=torch.float32).repeat(1, len(layers)))
    # one-hot by scatter: F.one_hot validates its indices, which can cost a device sync on CUDA
    chosen = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.softmax(logits, dim=-1)
    count = m.sum(dim=1)  # real tokens per row (times layers)
    share = (chosen * m[..., None]).sum(dim=1) / count.clamp(min=1.0)[:, None]
    prob = (probs * m[..., None]).sum(dim=1) / count.clamp(min=1.0)[:, None]
    per_row = (share * prob).mean(dim=-1) * experts**2
    rows = (count > 0).float()
    return (per_row * rows).sum() / rows.sum().clamp(min=1.0)


def expert_counts(groups: Sequence[Group], top_k: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(``(layers, experts)`` real tokens that chose each expert among their top-k, ``(layers,)`` real tokens
    each layer routed), the groups' layers in order; None without router logits. The top-k of the logits is the
    top-k of the softmax transformers routes by."""
    counts, tokens = [], []
    with torch.no_grad():
        for layers, mask in groups:
            if not layers:
                continue
            m = _flat_mask(layers[0], mask)
            weight = m.repeat_interleave(top_k)  # each token's k choices count once each
            for lay in layers:  # one layer at a time: no (layers, tokens, k) index tensor
                picks = lay.detach().reshape(-1, lay.shape[-1]).topk(top_k, dim=-1).indices.flatten()
                counts.append(torch.zeros(num_experts, dtype=torch.float32, device=m.device).scatter_add_(0, picks, weight))
            tokens.append(m.sum().expand(len(layers)))
    return (torch.stack(counts), torch.cat(tokens)) if counts else None
