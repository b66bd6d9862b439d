"""Which of transformers' experts implementations a mixture-of-experts model trains with (``model.experts_implementation``).

transformers 5 runs a routed-experts module (``@use_experts_implementation``) by ``config._experts_implementation``:
``eager`` (a Python loop over the experts hit, one ``linear`` per expert), ``batched_mm`` (one weight matrix
gathered per routed token, then a ``bmm``: built for decoding; in training it holds tokens x top_k expert
matrices) or ``grouped_mm`` (tokens sorted by expert, one grouped GEMM: ``torch._grouped_mm``, or where
transformers finds the kernel unusable its own loop of GEMMs). transformers defaults to ``grouped_mm`` and falls
back to ``eager`` for a model that cannot switch.

``auto`` picks ``grouped_mm``, except on a GPU whose expert weights are not bf16 (a full fine-tune keeps fp32
masters): torch's grouped kernel multiplies bf16 only and is not an autocast op. Under bf16 autocast there
trainforge's own grouped path (``experts_forward.py``) casts the weights for the GEMM as autocast casts eager's
per-expert ``linear``, and runs the grouped kernel; eager only without autocast. On this CPU ``grouped_mm`` was
1.6x faster than ``eager`` over forward and backward of a 16-expert, top-4 layer on 1024 tokens, in fp32, bf16
and fp32-under-bf16-autocast alike (docs/models.md).
"""

from __future__ import annotations

import torch

from .experts_forward import GROUPED_NAME, register_grouped
from .moe import expert_modules

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def grouped_kernel(device_type: str, weight_dtype: torch.dtype, capability: tuple[int, int] | None = None) -> bool:
    """Whether torch's grouped GEMM serves expert weights of this dtype on this device type (CUDA: bf16 on sm80+,
    ``capability`` where known; CPU: any dtype)."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if device_type == "cuda":
        return weight_dtype == torch.bfloat16 and (capability is None or capability >= (8, 0))
    return device_type == "cpu"


def choose(setting: str, device_type: str, weight_dtype: torch.dtype,
           capability: tuple[int, int] | None = None, autocast_dtype: torch.dtype | None = None) -> tuple[str, str]:
    """(implementation, why) for ``model.experts_implementation`` on this device type with expert weights of this
    dtype; ``capability``: the CUDA device's, where there is one (a plan for a profile has none); ``autocast_dtype``:
    the run's (bf16 autocast over fp32 masters takes trainforge's grouped path, which casts as autocast does)."""
    if setting != "auto":
        return setting, "model.experts_implementation"
    if device_type == "cpu":
        return "grouped_mm", "auto: faster than eager on CPU"
    if grouped_kernel(device_type, weight_dtype, capability):
        return "grouped_mm", f"auto: torch's grouped GEMM on {device_type} for bf16 expert weights"
    if autocast_dtype is not None and grouped_kernel(device_type, autocast_dtype, capability):  # CUDA: bf16 only
        return GROUPED_NAME, (f"auto: torch's grouped GEMM on autocast's bf16 copies of the "
                              f"{str(weight_dtype).removeprefix('torch.')} expert weights")
    return "eager", (f"auto: {str(weight_dtype).removeprefix('torch.')} expert weights on {device_type}, "
                     "which torch's grouped GEMM does not take")


def expert_weight_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the first routed experts' 3-D weights, or None for a model without routed experts."""
    for module in expert_modules(model):
        for p in module.parameters(recurse=False):
            if p.ndim == 3:
                return p.dtype
    return None


def settable(model: torch.nn.Module) -> bool:
    """Whether the model's experts run through transformers' experts interface (so their implementation can be set)."""
    mods = expert_modules(model)
    return bool(mods) and all(hasattr(m, "has_gate") for m in mods)


def use_experts_implementation(model: torch.nn.Module, setting: str, device: torch.device,
                               autocast_dtype: torch.dtype | None = None) -> tuple[str, str] | None:
    """Set the implementation ``setting`` resolves to on ``model`` (and its sub-models); (implementation, why),
    or None: a dense model, or experts outside the interface (they run their own forward; a set ``setting`` is
    then refused by ``check_settable``). ``autocast_dtype``: the run's autocast (see ``choose``)."""
    dtype = expert_weight_dtype(model)
    if dtype is None or not settable(model):
        return None
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    choice, why = choose(setting, device.type, dtype, capability, autocast_dtype)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if choice == GROUPED_NAME:
        register_grouped()  # trainforge's own, registered in transformers' experts interface
    elif hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation(choice)
    for m in expert_modules(model):  # the experts read their config at each forward: make sure each one's says so
        config = getattr(m, "config", None)
        if config is not None:
            config._experts_implementation_internal = choice
    return choice, why


def current(model: torch.nn.Module) -> str | None:
    """The implementation the model's routed experts run now, or None for a dense model. trainforge's grouped
    implementation (a LoRA of the experts as factors, ``lora_experts.py``) is ``grouped_mm``'s computation: so named."""
    mods = expert_modules(model)
    config = getattr(mods[0], "config", None) if mods else None
    name = getattr(config, "_experts_implementation", None) if config is not None else None
    return "grouped_mm" if name == GROUPED_NAME else name


def describe(model: torch.nn.Module) -> str:
    """', experts grouped_mm (why)' for the console's model line; empty for a dense model."""
    chosen = getattr(model, "trainforge_experts", None)
    return f", experts {chosen[0]} ({chosen[1]})" if chosen else ""
