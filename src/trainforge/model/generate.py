"""Sample text from a model: a quick look at what training taught it."""

from __future__ import annotations

import contextlib

import torch


@torch.no_grad()
def sample(
    model, tokenizer, prompt: str, max_new_tokens: int = 64, seed: int = 0, temperature: float = 0.8,
    autocast: contextlib.AbstractContextManager | None = None,
) -> str:
    """Continue ``prompt`` with seeded top-k sampling; returns prompt + continuation.
    ``autocast``: the run's precision context (a bf16 frozen base needs it, as training did)."""
    device = next(model.parameters()).device
    enc = tokenizer(prompt, return_tensors="pt").to(device)
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    with autocast or contextlib.nullcontext():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_k=50,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
    model.train(was_training)
    return tokenizer.decode(out[0], skip_special_tokens=True)
