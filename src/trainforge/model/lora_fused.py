"""LoRA layers whose update is added by the GEMM itself, without PEFT's casts and extra passes.

PEFT computes ``result + lora_B(lora_A(x.to(fp32))) * scaling``. Under autocast with fp32 adapters
(what PEFT makes by default, and what trainforge trains) that costs, in every adapted layer:
- an fp32 copy of the input ``x`` (written, read back, and cast to bf16 again by autocast), and that
  bf16 copy is what ``lora_A`` keeps for backward: one more activation-sized tensor per adapted layer
  (q, k and v each keep their own copy of the same ``x``), where the base layer's input is already kept;
- a multiply by ``scaling`` and an add over the layer's whole output, each a pass through memory, and
  the same again in backward.

The fused layer computes ``addmm(result, lora_A(dropout(x)), B^T, alpha=scaling)``: ``x`` goes to
``lora_A`` as it is (autocast casts only the small adapter weights), and the scaled update is
accumulated into the base output by the GEMM (one pass, one rounding). Same function, same
parameters, same checkpoints and exports (the layer keeps PEFT's class as its base); in fp32 it equals
PEFT's forward. Anything PEFT's forward does that this one does not (several or no active adapters,
DoRA and other variants, a LoRA bias, merged weights, per-sample adapter names, mixed dtypes without
autocast) runs PEFT's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .subclass import forward_subclass


def _single_adapter(layer: Any) -> str | None:
    """The one active plain-LoRA adapter of ``layer``, or None when PEFT's forward must run."""
    if layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A:
        return None
    name = active[0]
    # a variant (DoRA, ...): PEFT 0.15+ lists it in lora_variant, earlier releases flag DoRA in use_dora
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name):
        return None
    if not isinstance(layer.scaling.get(name), (int, float)):  # addmm's alpha is a number, not a tensor
        return None
    return None if layer.lora_B[name].bias is not None else name


def fused_lora_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``layer``'s output with the LoRA update added by ``addmm``; PEFT's forward where that does not apply."""
    name = _single_adapter(layer) if not args and not kwargs else None
    if name is None:
        return layer._peft_forward(x, *args, **kwargs)
    a, b, scaling = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if not autocast and not x.dtype == a.dtype == b.dtype:
        return layer._peft_forward(x)  # no autocast to reconcile dtypes: PEFT casts the input to the adapters'
    result = layer.base_layer(x)
    dropped = layer.lora_dropout[name](x)  # x as it is: no fp32 copy, and lora_A keeps the base's input
    if result.dtype != (torch.get_autocast_dtype(device_type) if autocast else a.dtype):
        # the base answered in another dtype (QLoRA's 4-bit layers return their fp32 input's dtype):
        # PEFT's sum and type promotion, without running the base again
        return (result + layer.lora_B[name](layer.lora_A[name](dropped)) * scaling).to(result.dtype)
    xa = F.linear(dropped, a)
    # result + scaling * (xa @ B^T) in the GEMM's epilogue: one pass over the output, one rounding
    out = torch.addmm(result.reshape(-1, result.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(), alpha=scaling)
    return out.view(result.shape)


_FUSED: dict[type, type] = {}


def fused_class(cls: type) -> type:
    """A subclass of PEFT's LoRA layer class ``cls`` whose forward is ``fused_lora_forward`` (one per class)."""
    return forward_subclass(cls, _FUSED, "Fused", fused_lora_forward, "_peft_forward",
                            f"PEFT's {cls.__name__} with the LoRA update added by the GEMM (trainforge.model.lora_fused).")


def lora_layer_classes() -> tuple[type, ...]:
    """PEFT's LoRA layer classes whose forward the fused one replaces: over a linear layer (and GPT-2's
    Conv1D), and over a bitsandbytes 4-bit layer (QLoRA) when bitsandbytes is installed."""
    from peft.tuners.lora.layer import Linear

    classes: list[type] = [Linear]
    try:
        from peft.tuners.lora.bnb import Linear4bit

        classes.append(Linear4bit)
    except ImportError:  # no bitsandbytes: PEFT defines no 4-bit layer
        pass
    return tuple(classes)


def fuse_lora_layers(model: torch.nn.Module) -> int:
    """Give every PEFT LoRA layer of ``model`` the fused forward, in place (the module keeps its weights,
    names and PEFT's class as its base, so saving, merging and loading see PEFT's layer). Returns how
    many layers changed."""
    classes = lora_layer_classes()
    count = 0
    for module in model.modules():
        if type(module) in classes:
            module.__class__ = fused_class(type(module))
            count += 1
    return count
