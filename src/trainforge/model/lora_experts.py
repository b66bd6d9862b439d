"""LoRA on the routed experts' 3-D weights without building ``W + B A``.

PEFT adapts a 3-D expert weight (``target_parameters``) by a parametrization: at every forward (and again in a
checkpointed recompute) it computes ``W + scaling B A`` for every expert of the layer, a tensor as large as the
layer's experts, which the grouped GEMM then keeps for backward and whose gradient is as large again. Only
``top_k`` experts' rows are routed per token, so that pass over all the experts' weights is most of a LoRA MoE
step where tokens per expert are few (``docs/models.md``: the plan priced Qwen3-30B-A3B LoRA memory-bound).

Here the wrapper hands the experts module its LoRA factors instead, and ``trainforge_grouped``
(``experts_forward.py``) adds ``scaling (x A_e) B_e`` per routed row: two grouped GEMMs of rank r. Same function,
same parameters (PEFT's ``lora_A`` / ``lora_B``, the layer keeps PEFT's class as its base: checkpoints, exports and
``export --merge`` are PEFT's). Anything else (several or no active adapters, a merged or disabled adapter, DoRA
or another variant, a LoRA bias or dropout, an experts implementation other than the grouped one) runs PEFT's
own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import TrainforgeError
from .experts_forward import GROUPED_NAME, LORA_STASH, NF4_STASH, register_grouped
from .subclass import forward_subclass

_FACTORED: dict[type, type] = {}


def _factors(wrapper: Any) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(lhs (experts, d0, r), rhs (experts, r, d1), scaling)`` with ``W + scaling lhs @ rhs`` the adapted weight
    of layout (experts, d0, d1); None where PEFT's forward must run."""
    if wrapper.disable_adapters or wrapper.merged or len(wrapper.active_adapters) != 1:
        return None
    name = wrapper.active_adapters[0]
    if name not in wrapper.lora_A or name in getattr(wrapper, "lora_variant", {}) or wrapper.lora_B[name].bias is not None:
        return None
    if not isinstance(wrapper.lora_dropout[name], torch.nn.Identity) or not isinstance(wrapper.scaling.get(name), (int, float)):
        return None
    experts = wrapper.num_experts
    a = wrapper.lora_A[name].weight.reshape(experts, -1, wrapper.lora_A[name].weight.shape[-1])  # (experts, r, in)
    b = wrapper.lora_B[name].weight  # (out, r x experts): PEFT keeps the expert index last
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # (experts, out, r)
    # PEFT's in/out follow the stored layout; where it swapped them the weight is (experts, out, in)
    lhs, rhs = (b, a) if getattr(wrapper, "_did_swap_in_out_features", False) else (a.transpose(-2, -1), b.transpose(-2, -1))
    return lhs, rhs, wrapper.scaling[name]


def factored_forward(wrapper: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The experts' output with every LoRA of this chain of wrappers passed down as factors; PEFT's forward where
    that does not apply."""
    stash: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    layer = wrapper
    while isinstance(layer, tuple(_FACTORED.values())):  # wrappers of one module nest: one per adapted weight
        factors = _factors(layer)
        if factors is None:
            return _peft_forward(wrapper, x, *args, **kwargs)
        stash[layer.parameter_name] = factors
        layer = layer.base_layer
    config = getattr(layer, "config", None)
    static = getattr(layer, "_trainforge_autocast", None) is not None  # a plan's traced stand-in reads the factors too
    if not static and getattr(config, "_experts_implementation", None) != GROUPED_NAME:
        return _peft_forward(wrapper, x, *args, **kwargs)
    transposed = layer.is_transposed
    for name, (lhs, rhs, scaling) in stash.items():
        dtype = getattr(layer, name).dtype  # the factors in the weight's dtype, as PEFT's W + B A is
        # rows @ W: W (experts, in, out) when transposed, else (experts, out, in) used as its transpose
        a, b = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
        a, b = a.to(dtype), b.to(dtype)
        # the grouped GEMM takes rows of a multiple of 16 bytes (r = 4 in bf16 is 8): zero rank slots up to one,
        # which adds nothing to the product
        pad = -a.shape[-1] % (16 // a.element_size())
        if pad:
            a, b = torch.nn.functional.pad(a, (0, pad)), torch.nn.functional.pad(b, (0, 0, 0, pad))
        stash[name] = (a.contiguous(), b.contiguous(), scaling)  # contiguous, as the kernel takes them (rank-r: small)
    setattr(layer, LORA_STASH, stash)
    try:
        return layer(x, *args, **kwargs)
    finally:
        setattr(layer, LORA_STASH, None)


def _peft_forward(wrapper: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's own forward (``W + B A``), which needs the experts' weights as values: not for 4-bit experts."""
    if getattr(wrapper.get_base_layer(), NF4_STASH, None):
        raise UnsupportedExpertsLora(
            "model.lora: the routed experts are 4-bit (QLoRA) and this adapter set-up needs PEFT's W + B A (several "
            "active adapters, a merged adapter, DoRA, or LoRA dropout or bias on the experts): use one plain adapter "
            "with model.lora.dropout: 0, or model.method: lora")
    return wrapper._peft_forward(x, *args, **kwargs)


class UnsupportedExpertsLora(TrainforgeError, RuntimeError):
    """An adapter set-up on 4-bit experts that only PEFT's forward computes (it needs their weights as values)."""


def factored_class(cls: type) -> type:
    """A subclass of PEFT's ``ParamWrapper`` whose forward is ``factored_forward`` (one per class)."""
    return forward_subclass(cls, _FACTORED, "Factored", factored_forward, "_peft_forward",
                            "PEFT's ParamWrapper passing its LoRA factors to the experts (trainforge.model.lora_experts).")


def factor_expert_lora(model: torch.nn.Module) -> int:
    """Give every PEFT wrapper of a routed-experts weight the factored forward, and the experts that run transformers'
    ``grouped_mm`` trainforge's grouped implementation (the same computation, reading the factors), in place.
    Returns how many weights are adapted so; 0 for a model without adapted experts."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # a PEFT without target_parameters: nothing wraps a 3-D weight
        return 0
    count = 0
    for module in model.modules():
        if type(module) is ParamWrapper and getattr(module, "num_experts", 1) > 1:
            module.__class__ = factored_class(ParamWrapper)
            count += 1
            base = module.get_base_layer()
            config = getattr(base, "config", None)
            if hasattr(base, "has_gate") and getattr(config, "_experts_implementation", None) == "grouped_mm":
                config._experts_implementation_internal = register_grouped()
    return count
