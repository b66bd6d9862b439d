"""QLoRA of the routed experts: their 3-D weights in 4-bit NF4.

bitsandbytes quantizes ``nn.Linear`` layers only, so under ``model.method: qlora`` transformers 5's experts (3-D
``gate_up_proj`` / ``down_proj`` parameters) stayed in bf16: most of an MoE's weights (54 of Qwen3-30B-A3B's 57 GiB).
Here each such weight is quantized as QLoRA quantizes a linear layer (NF4, blocks of 64, double quantization:
about 0.52 bytes per weight) and the parameter is replaced by a placeholder of its shape and dtype that holds no
memory (one element, broadcast), which carries the ``quant_state`` (so ``weight_storage`` and the summary count it
as nf4). trainforge's grouped experts (``experts_forward.py``) dequantize one weight for one GEMM at a time, in
forward and again in backward; LoRA adapters on the experts (PEFT's ``target_parameters``) add their update as
factors. No other experts path can read these weights: the implementation is trainforge's grouped one, and a
setting that asks for another is refused.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..config.run import ConfigError
from .experts_forward import GROUPED_NAME, NF4_STASH, register_grouped
from .moe import expert_modules

NF4_BLOCK = 64  # bitsandbytes' default QLoRA block, as the linear layers' (BitsAndBytesConfig)
NF4_CONST_BLOCK = 256  # double quantization: one fp32 constant per 256 of the 8-bit block constants


def nf4_bytes(weights: int) -> int:
    """What ``weights`` weights take in NF4 with double quantization: 4 bits each, an 8-bit constant per block of
    ``NF4_BLOCK``, an fp32 constant per ``NF4_CONST_BLOCK`` blocks."""
    blocks = -(-weights // NF4_BLOCK)
    return (weights + 1) // 2 + blocks + 4 * -(-blocks // NF4_CONST_BLOCK)


def _quantized(weight: torch.Tensor):
    """``(packed bytes, QuantState)`` of ``weight`` in NF4 as QLoRA quantizes a linear layer (blocks of ``NF4_BLOCK``,
    double quantization)."""
    import bitsandbytes.functional as bnbf

    return bnbf.quantize_4bit(weight, blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4")


def quantize_experts(model: torch.nn.Module) -> int:
    """Quantize every routed expert weight of ``model`` to NF4 in place; returns how many weights. Experts outside
    transformers' experts interface are left as they are (0 for them)."""
    count = 0
    for module in expert_modules(model):
        config = getattr(module, "config", None)
        if not hasattr(module, "has_gate") or config is None:
            continue
        chosen = getattr(config, "_experts_implementation", None)
        if chosen not in ("grouped_mm", GROUPED_NAME):
            raise ConfigError(
                f"model.experts_implementation: {chosen} cannot run 4-bit experts; QLoRA quantizes the routed experts "
                "and computes them on trainforge's grouped path: set it to auto or grouped_mm")
        stash = getattr(module, NF4_STASH, None) or {}
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim != 3 or name in stash or param.is_meta or is_fake(param):
                continue  # a plan's skeleton has no values: the plan prices the experts in NF4 (predict/moe.py)
            packed, state = _quantized(param.data)
            # a weight of the same shape and dtype (what PEFT's wrappers, the plan and the facts read) holding one element
            placeholder = torch.nn.Parameter(torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape),
                                             requires_grad=False)
            placeholder.quant_state = state
            setattr(module, name, placeholder)
            stash[name] = (packed, state)
            count += 1
        setattr(module, NF4_STASH, stash)
        config._experts_implementation_internal = register_grouped()
    return count


def round_experts_through_nf4(model: torch.nn.Module) -> int:
    """Replace every routed expert weight of ``model`` by its NF4 values, in place (its dtype kept): what a QLoRA run
    computed with, for ``export --merge`` to merge the adapters into. Returns how many weights."""
    import bitsandbytes.functional as bnbf

    count = 0
    for module in expert_modules(model):
        for param in module.parameters(recurse=False):
            if param.ndim == 3:
                packed, state = _quantized(param.data)
                param.data.copy_(bnbf.dequantize_4bit(packed, state))
                count += 1
    return count
