"""Liger's RMSNorm and SwiGLU as a plan traces them (``train.kernels: liger``, engine/predict/trace.py).

Triton kernels do not run on fake tensors, so the traced model gets stand-ins that keep for backward
what Liger's kernels keep and allocate what they allocate. The values they compute are meaningless, and
their ops stand in for the fused kernels' memory traffic in the time model. From liger-kernel 0.8's
``ops/rms_norm.py`` and ``ops/swiglu.py``:
- RMSNorm keeps its input and one fp32 reciprocal RMS per row. torch's RMSNorm also keeps the
  normalized input in fp32, one row x hidden tensor per norm. Its backward writes dX into dY's buffer.
- SwiGLU keeps the gate and up projections' outputs. torch also keeps silu(gate), one row x
  intermediate tensor per layer. Its backward writes the two gradients into those two buffers.
"""

from __future__ import annotations

import types

import torch

from ...model.kernels import liger_apply_function


class _RMSNormStandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):  # no annotations: autograd.Function checks none
        rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
        y = torch.mul(x, weight.to(x.dtype))  # one read of x, one write of y: the fused kernel's traffic
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, _ = ctx.saved_tensors
        dx = dy.mul_(x) if dy.is_contiguous() else dy * x  # Liger: dX written into dY's buffer
        return dx, torch.zeros_like(weight) if ctx.needs_input_grad[1] else None


class _SiluMulStandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.mul(gate, up)  # silu(gate) * up in one pass: no silu(gate) tensor is kept

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return gate.mul_(grad), up.mul_(grad)  # Liger: both gradients written into the saved buffers


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNormStandIn.apply(hidden_states, self.weight)


def _swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_SiluMulStandIn.apply(self.gate_proj(x), self.up_proj(x)))


def use_liger_stand_ins(model: torch.nn.Module) -> list[str]:
    """Give ``model``'s norms and MLPs the stand-ins of the Liger kernels ``apply_liger`` would swap in for
    its architecture, in place; returns those kernels (none: Liger does not know the architecture)."""
    config = model.config
    _, kernels = liger_apply_function(getattr(config, "model_type", None))
    swiglu = "swiglu" in kernels and getattr(config, "hidden_act", None) in ("silu", "swish")
    used = set()
    for module in model.modules():
        if "rms_norm" in kernels and type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
            module.forward = types.MethodType(_rms_norm_forward, module)
            used.add("rms_norm")
        elif swiglu and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
            module.forward = types.MethodType(_swiglu_forward, module)
            used.add("swiglu")
    return sorted(used)
