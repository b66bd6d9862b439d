"""A model at full precision for export: a full model in fp32, or a LoRA / DoRA / QLoRA adapter merged into its base.

QLoRA: the adapters were trained against the 4-bit NF4 base, not the original weights, so the base is loaded
in NF4 exactly as the run trained it and *dequantized* once to fp32 before merging: the merged model computes
what the QLoRA model computed (up to rounding; the routed experts of an MoE, which trainforge quantizes itself,
are rounded through NF4 the same way); merging into the original unquantized weights instead would
shift every layer by its quantization error, and merging into the 4-bit values would round the adapter away.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..metrics.console import ConsoleReporter
from ..model.inputs import settle_inputs
from ..model.load import auto_model_class
from ..model.nf4_experts import round_experts_through_nf4
from ..model.resolve import ModelSource, load_source_tokenizer


def merged_model(src: ModelSource, reporter: ConsoleReporter) -> tuple[torch.nn.Module, Any]:
    """(the adapter folded into its base, in fp32, without PEFT; the tokenizer). QLoRA: the base is loaded
    in 4-bit NF4 as it trained and dequantized to fp32 once before merging."""
    from peft import PeftModel

    tokenizer = load_source_tokenizer(src)
    auto_class = auto_model_class(src.encoder_decoder, src.model_type)
    if src.quantized:
        from ..model.load import nf4_config

        reporter.info("QLoRA: loading the base in 4-bit NF4 as it trained, dequantizing it to fp32, then merging")
        base = auto_class.from_pretrained(
            str(src.base), dtype=torch.float32, quantization_config=nf4_config(torch.float32), trust_remote_code=False
        )
        base = base.dequantize(dtype=torch.float32)
        round_experts_through_nf4(base)  # bitsandbytes left the routed experts' 3-D weights: trainforge quantized them
    else:
        base = auto_class.from_pretrained(str(src.base), dtype=torch.float32, trust_remote_code=False)
    if base.get_input_embeddings().num_embeddings < len(tokenizer):
        base.resize_token_embeddings(len(tokenizer))  # as training did
    settle_inputs(base.config)  # as training did too (X-MOD's only language): the merged model's config keeps it
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(base, str(src.weights))
    merged = model.merge_and_unload(safe_merge=True)  # safe_merge: refuses to write NaNs into the weights
    return merged, tokenizer


def full_model(src: ModelSource, reporter: ConsoleReporter) -> tuple[torch.nn.Module, Any]:
    """(the model ``src`` names in fp32, an adapter merged into its base; the tokenizer)."""
    if src.adapter is not None:
        return merged_model(src, reporter)
    model = auto_model_class(src.encoder_decoder, src.model_type).from_pretrained(str(src.weights), dtype=torch.float32, trust_remote_code=False)
    return model, load_source_tokenizer(src)
