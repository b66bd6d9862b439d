"""Build the model a run trains: pretrained from a local directory or from scratch, full or LoRA."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..config import LoraSettings, ModelSettings


def init_config(init: dict[str, Any], tokenizer):
    """A transformers config from ``model.init``, sized to the tokenizer and its special tokens."""
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in init.items() if k != "architecture"}
    fields.setdefault("vocab_size", len(tokenizer))
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"model.init.vocab_size={fields['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )
    fields.setdefault("eos_token_id", tokenizer.eos_token_id)
    fields.setdefault("pad_token_id", tokenizer.pad_token_id)
    fields.setdefault("bos_token_id", tokenizer.bos_token_id)
    return CONFIG_MAPPING[init["architecture"]](**fields)


def attention_implementation(requested: str, device: torch.device, half_precision: bool = True) -> str:
    """``auto``: flash-attention 2 on CUDA when installed and the run computes in bf16/fp16
    (packed documents go through its varlen kernel; it refuses fp32 inputs), stock SDPA
    elsewhere on CUDA (a block-diagonal mask for packed rows), and on CPU packed documents
    batched by length (no row-sized mask; see packed_attention.py)."""
    if requested == "packed_sdpa" or (requested == "auto" and device.type == "cpu"):
        from .packed_attention import register

        return register()
    if requested != "auto":
        return requested
    if device.type == "cuda" and half_precision:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return "sdpa"


def build_model(
    cfg: ModelSettings, tokenizer, seed: int, device: torch.device | None = None, half_precision: bool = True
) -> torch.nn.Module:
    """The trainable model: weights loaded or seeded-initialized, LoRA-wrapped when asked.
    ``half_precision``: the run computes in bf16/fp16 (decides whether flash-attention can serve)."""
    from transformers import AutoModelForCausalLM

    attn = attention_implementation(cfg.attention, device or torch.device("cpu"), half_precision)
    torch.manual_seed(seed)  # same seed, same initial weights (from scratch) and adapters (LoRA)
    if cfg.init is not None:
        model = AutoModelForCausalLM.from_config(
            init_config(cfg.init, tokenizer), dtype=torch.float32, attn_implementation=attn
        )
    else:
        # keep master weights in fp32: autocast handles the low-precision compute
        model = AutoModelForCausalLM.from_pretrained(str(cfg.path.resolve()), dtype=torch.float32, attn_implementation=attn)
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    if cfg.method == "lora":
        model = apply_lora(model, cfg.lora)
    return model


def apply_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """Wrap with PEFT LoRA adapters; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total
