"""Image-text checkpoints (Gemma 3, Mistral 3, Qwen2.5-VL, Llama 3.2 Vision, Emu3, ...) trained on text alone.

transformers maps most of these model types to their ``...ForConditionalGeneration`` class under
``AutoModelForCausalLM``: the whole model loads, and text rows (no ``pixel_values``) run only its language
model. A few (Mllama, Emu3) map to a text-only ``...ForCausalLM`` built from the text sub-config: given the
published checkpoint (the full config), it would load the language model alone and save a directory
without the vision parts; ``image_text_class`` gives those model types their image-text class instead.
The parts beside the language model (vision tower, projector, VQ-VAE) take no part in a text step: they are
frozen, left out of LoRA's ``all-linear``, and saved unchanged, so ``final/`` (or a merged export) is still
the full image-text model transformers loads.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

LANGUAGE_MODELS = ("language_model", "text_model")  # the language model's attribute in transformers' image-text models


@lru_cache(maxsize=64)
def image_text_class(model_type: str | None):
    """``AutoModelForImageTextToText`` where ``AutoModelForCausalLM`` would build only the language model of
    this model type's full image-text config (its causal-LM class takes the text sub-config), else None."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return None
    text_config = getattr(CONFIG_MAPPING[model_type], "sub_configs", {}).get("text_config")
    causal = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    takes_text_config = text_config is not None and getattr(causal, "config_class", None) is text_config
    return AutoModelForImageTextToText if takes_text_config else None


def refuse_a_part(model_type: str | None) -> None:
    """``UnsupportedModelDir`` (exit 2) where transformers' causal-LM class of this model type is one part of its
    composite config other than a language model (MusicGen: the audio-code decoder beside a text encoder): no
    auto class trainforge loads builds the published checkpoint, which would stop with a traceback."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..hf_dir import UnsupportedModelDir

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    config = CONFIG_MAPPING[model_type]
    causal = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    parts = {cls: key for key, cls in getattr(config, "sub_configs", {}).items() if key != "text_config"}
    part = parts.get(getattr(causal, "config_class", None))
    if part is not None:
        raise UnsupportedModelDir(
            f"model.path: a {model_type} checkpoint ({config.__name__}: {', '.join(config.sub_configs)}) is not a "
            f"language model: transformers' causal-LM class {causal.__name__} is its {part} alone, built from a "
            f"{causal.config_class.__name__}, and cannot load the whole; trainforge trains text models (decoder-only "
            "or encoder-decoder): give the directory of one"
        )


def refuse_a_drafter(model_type: str | None) -> None:
    """``UnsupportedModelDir`` (exit 2) for a drafter of assisted generation (transformers' ``*_assistant`` model types,
    Gemma 4's): each of its layers attends with the key/value states its target model computed (``shared_kv_states``),
    so its forward does not run without that model, and a fine-tune on text alone has nothing to run."""
    from ..hf_dir import UnsupportedModelDir

    if model_type and model_type.endswith("_assistant"):
        target = model_type.removesuffix("_assistant")
        raise UnsupportedModelDir(
            f"model.path: a {model_type} checkpoint is a drafter for assisted generation: every layer reads the key/value "
            f"states of its target model (a {target} model), so it does not run, nor train, on its own; fine-tune the "
            f"{target} model's directory instead"
        )


def non_text_parts(model: torch.nn.Module) -> list[str]:
    """Full names of the submodules beside the language model of an image-text model (empty for a text model)."""
    for name, module in model.named_modules():
        children = dict(module.named_children())
        text = next((c for c in LANGUAGE_MODELS if c in children), None)
        if text is not None and len(children) > 1:
            return [f"{name}.{child}" if name else child for child in children if child != text]
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
