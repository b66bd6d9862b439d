"""Mixture-of-experts layers as a plan traces them: every expert held, each token routed to ``top_k`` of them.

The experts' own forward cannot run on fake tensors: routing decides how many tokens each expert gets
(transformers' eager loop branches on ``nonzero``), and torch's ``grouped_mm`` meta function accepts bf16
only. During a trace each routed-experts module (transformers' ``@use_experts_implementation`` classes:
3-D ``gate_up_proj``/``down_proj`` weights) instead runs a shape-static stand-in that routes every token to
``top_k`` experts spread evenly: each expert gets ``tokens x top_k / experts`` rows (rounded up) and one
``bmm`` does all experts' GEMMs. So:

- memory holds every expert's weights (they are parameters; gradients and optimizer state where trained);
  the routed rows are gathered, projected, gated and weighted as the grouped kernel does, and backward keeps
  what it keeps (the gathered input of each GEMM);
- time counts the routed FLOPs only (top-k of the experts), and the ``bmm``'s bytes read include every
  expert's weights: with few tokens per expert the layer is priced memory-bound, as the grouped GEMM is.

Precision follows the implementation the run will use (``model/experts_impl.py``): ``grouped_mm`` is not
autocast (it multiplies in the weights' dtype: fp32 master weights stay fp32), eager's per-expert
``linear`` is (its bf16 copies of the expert weights are kept for backward), and so is trainforge's grouped path
on a GPU (it casts as autocast does); ``batched_mm`` is shape-static
already and is traced as it is (it gathers one weight matrix per routed token: a memory a plan must show).
"""

from __future__ import annotations

import contextlib
import types

import torch

from ...errors import TrainforgeError
from ...model.experts_forward import CAST_DEVICES, GROUPED_NAME, lora_of, routed_experts
from ...model.experts_impl import choose, expert_weight_dtype
from ...model.moe import expert_modules

STATIC_IMPLEMENTATIONS = ("batched_mm",)  # transformers' implementations that already trace on fake tensors


def _balanced_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool, autocast: bool) -> torch.Tensor:
    """``x`` (routed rows, sorted by expert) times each expert's weight, every expert taking an equal share of
    the rows: one ``bmm`` over (experts, rows per expert, in) x (experts, in, out)."""
    experts = weight.shape[0]
    w = weight if transposed else weight.transpose(-2, -1)  # (experts, in, out)
    rows = x.shape[0]
    per = -(-rows // experts)
    if per * experts != rows:  # uneven: pad to whole shares (at most experts - 1 rows; none for usual shapes)
        x = torch.cat([x, x.new_zeros(per * experts - rows, x.shape[1])])
    with contextlib.ExitStack() as stack:
        if not autocast:  # grouped_mm is not an autocast op: it runs in the weights' dtype
            stack.enter_context(torch.autocast(x.device.type, enabled=False))
            x = x.to(w.dtype)
        out = torch.bmm(x.view(experts, per, x.shape[1]), w).view(experts * per, w.shape[-1])
    return out[:rows] if per * experts != rows else out


def _static_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward (``model/experts_forward.py``) with the grouped GEMM replaced by
    ``_balanced_linear``: the same tensors, of static shapes; a LoRA of the experts as the run computes it."""
    autocast = self._trainforge_autocast

    def project(rows: torch.Tensor, name: str, expert_ids: torch.Tensor) -> torch.Tensor:
        out = _balanced_linear(rows, getattr(self, name), self.is_transposed, autocast)  # a parametrization applies
        lora = lora_of(self, name)
        if lora is not None:  # factored (model/lora_experts.py): two rank-r GEMMs per expert
            a, b, scaling = lora
            out = out + _balanced_linear(_balanced_linear(rows, a, True, autocast), b, True, autocast) * scaling
        return out

    return routed_experts(self, hidden_states, top_k_index, top_k_weights, project)


def trace_experts(model: torch.nn.Module, setting: str, device_type: str,
                  autocast_dtype: torch.dtype | None = None) -> str | None:
    """Prepare a traced model's routed experts as the run will run them on ``device_type`` under ``autocast_dtype``:
    the implementation ``setting`` (``model.experts_implementation``) resolves to, through its shape-static
    stand-in. Returns that implementation, or None for a dense model."""
    dtype = expert_weight_dtype(model)
    if dtype is None:
        return None
    choice, _ = choose(setting, device_type, dtype, autocast_dtype=autocast_dtype)
    for module in expert_modules(model):
        config = getattr(module, "config", None)
        if config is not None:  # batched_mm runs transformers' own forward, which reads it
            config._experts_implementation_internal = choice
    use_static_routing(model, choice, device_type)
    return choice


def use_static_routing(model: torch.nn.Module, implementation: str, device_type: str = "cpu") -> int:
    """Give each routed-experts module of ``model`` the shape-static stand-in of ``implementation``, in place;
    returns how many got one. ``batched_mm`` needs none; a module that is not transformers' experts interface
    (no ``has_gate``) is one this plan cannot trace: ``UntraceableExperts``."""
    if implementation in STATIC_IMPLEMENTATIONS:
        return 0
    swapped = 0
    for module in expert_modules(model):
        if not hasattr(module, "has_gate"):
            raise UntraceableExperts(type(module).__name__)
        # eager's linear is an autocast op; trainforge's grouped path casts as autocast does where it casts at all
        module._trainforge_autocast = implementation == "eager" or (implementation == GROUPED_NAME and device_type in CAST_DEVICES)
        module.forward = types.MethodType(_static_experts_forward, module)
        swapped += 1
    return swapped


def nf4_experts_priced(model: torch.nn.Module, parts: dict[str, int], peak: int, compute_dtype: torch.dtype) -> int:
    """A traced step that held the routed experts in 16 bits priced as QLoRA runs them (``model/nf4_experts.py``):
    ``parts``' weights in NF4 and, in its temporaries, the largest expert weight dequantized (one lives at a time,
    for its GEMM); returns the peak so changed. A dense model: nothing changes."""
    from ...model.nf4_experts import nf4_bytes

    weights = [p for m in expert_modules(model) for p in m.parameters(recurse=False) if p.ndim == 3]
    saved = sum(p.numel() * p.element_size() - nf4_bytes(p.numel()) for p in weights)
    dequantized = max((p.numel() * compute_dtype.itemsize for p in weights), default=0)
    parts["weights"] -= saved
    parts["temporaries"] += dequantized
    return peak - saved + dequantized


class UntraceableExperts(TrainforgeError, RuntimeError):
    """A routed-experts module outside transformers' experts interface: its routing cannot be traced statically."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"plan: {name} keeps its experts outside transformers' experts interface (@use_experts_implementation), "
            "so its routing cannot be traced on fake tensors; plan has no prediction for this architecture: "
            "run `trainforge train` with a small train.max_steps to measure it instead")
