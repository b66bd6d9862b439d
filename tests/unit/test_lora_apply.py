"""LoRA on model types with quirks of their own (``model/lora_apply.py``)."""

from __future__ import annotations

import torch

from trainforge.config.run import LoraSettings
from trainforge.model.load import apply_lora


def test_lora_on_reformers_reversible_layers_gets_gradients():
    """Reformer's reversible layers recompute themselves in a custom backward: with the embeddings frozen nothing
    entering them needed a gradient, the loss had no grad_fn (RuntimeError: element 0 of tensors does not require
    grad), and LoRA could not train. The embeddings' output now requires grad, so the adapters get theirs."""
    from transformers import AutoModelForCausalLM

    from trainforge.tools.family_shrink import tiny_config

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(tiny_config("reformer", 64, {})), LoraSettings(r=4, alpha=8))
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # B's first gradient
