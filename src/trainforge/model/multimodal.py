"""Image-text checkpoints (Gemma 3, Mistral 3, Qwen2.5-VL, ...) trained on text alone.

transformers maps these model types to their ``...ForConditionalGeneration`` class under
``AutoModelForCausalLM``: the whole model loads, and text rows (no ``pixel_values``) run only its language
model. The parts beside the language model (vision tower, projector) take no part in a text step: they are
frozen, left out of LoRA's ``all-linear``, and saved unchanged, so ``final/`` (or a merged export) is still
the full image-text model transformers loads.
"""

from __future__ import annotations

import re

import torch


def non_text_parts(model: torch.nn.Module) -> list[str]:
    """Full names of the submodules beside the language model of an image-text model (empty for a text model)."""
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "language_model" in children and len(children) > 1:
            return [f"{name}.{child}" if name else child for child in children if child != "language_model"]
    return []


def freeze_non_text(model: torch.nn.Module) -> int:
    """Freeze the parts beside the language model; the number of weights frozen."""
    frozen = 0
    for name in non_text_parts(model):
        for p in model.get_submodule(name).parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def lora_exclusion(model: torch.nn.Module) -> str | None:
    """A regular expression over module names that keeps LoRA off the parts beside the language model (PEFT's
    ``exclude_modules``), or None for a text model."""
    parts = non_text_parts(model)
    return "|".join(rf"{re.escape(p)}(\..*)?" for p in parts) if parts else None


def describe_text_only(model: torch.nn.Module, frozen: int) -> str | None:
    """The console note of an image-text checkpoint trained on text, or None for a text model."""
    parts = non_text_parts(model)
    if not parts:
        return None
    names = ", ".join(p.rsplit(".", 1)[-1] for p in parts)
    return (f"model.path is an image-text model ({type(model).__name__}): text data trains its language model; "
            f"{names} ({frozen:,} weights) stay frozen and are saved unchanged with it")
