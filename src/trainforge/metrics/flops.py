"""Model FLOPs per trained token, for MFU.

FLOPs per token (PaLM appendix B convention, matmuls only):
- a weight matrix of n parameters costs 2n forward, 2n for the input gradient, and 2n
  for its weight gradient only when it is trained (LoRA: frozen weights skip that);
- a mixture-of-experts layer's routed experts count top_k / experts of their weights (the experts a token
  runs through); shared experts and the router run for every token and count in full;
- attention scores and values cost 2 x 2 x layers x width x context forward, x3 with backward,
  counted over the full row length.
MFU = achieved model FLOP/s / peak FLOP/s of the device in the precision used (``hardware.peak_flops``).
"""

from __future__ import annotations

import torch

from ..model.moe import active_share

def linear_params(model: torch.nn.Module) -> tuple[float, float]:
    """(trained, frozen) parameter counts of the matrices that multiply activations (not embeddings), as one token
    sees them: a mixture-of-experts layer's routed experts (3-D weights) count top_k / experts of their size."""
    trained = frozen = 0.0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    routed = active_share(model)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in routed:
                n = p.numel() * routed[id(p)]
            elif p.ndim != 2 or id(p) in embeddings and not isinstance(module, torch.nn.Linear):
                continue
            else:
                n = p.numel()
            if p.requires_grad:
                trained += n
            else:
                frozen += n
    return trained, frozen


def flops_per_token(model: torch.nn.Module, context: int, target_share: float | None = None) -> float:
    """Training FLOPs per token: forward + backward, LoRA-aware.

    Encoder-decoder models (``target_share``: the targets' share of all tokens): a source token
    runs through the encoder's matrices only, a target token through the decoder's and the head."""
    trained, frozen = linear_params(model)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    width = getattr(config, "hidden_size", 0) or 0
    attention = 2 * 2 * layers * width * context * 3
    encoder = model.get_encoder() if target_share is not None and hasattr(model, "get_encoder") else None
    if encoder is None:
        return 6.0 * trained + 4.0 * frozen + attention
    enc_trained, enc_frozen = linear_params(encoder)
    source = 6.0 * enc_trained + 4.0 * enc_frozen
    target = 6.0 * (trained - enc_trained) + 4.0 * (frozen - enc_frozen)
    return (1.0 - target_share) * source + target_share * target + attention
