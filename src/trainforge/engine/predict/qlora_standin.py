"""QLoRA in a traced step: bitsandbytes' NF4 linear layers stood in for by layers that keep what they keep (a packed
4-bit weight and its block constants) and allocate what they allocate (a dequantized copy for each matmul)."""

from __future__ import annotations

import torch

from ...model.nf4_experts import NF4_BLOCK, NF4_CONST_BLOCK  # the run's NF4 layout, priced here


class _Dequantized4bitMatmul(torch.autograd.Function):
    """``x @ W.T`` where ``W`` is dequantized from 4 bits for the forward and again for the backward,
    and only the packed weight is kept in between (what bitsandbytes' 4-bit matmul does)."""

    @staticmethod
    def forward(ctx, x, packed, shape, dtype):  # noqa: ANN001 - autograd.Function
        ctx.save_for_backward(packed)
        ctx.shape, ctx.dtype = shape, dtype
        w = torch.zeros(shape, dtype=dtype, device=x.device)  # the dequantized copy: a temporary
        return x.to(dtype) @ w.t()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        w = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        return grad @ w, None, None, None


class FourBitLinear(torch.nn.Module):
    """Stands in for a bitsandbytes NF4 linear layer in a trace: 4 bits per weight, 8-bit block
    constants (one per ``NF4_BLOCK`` weights) with an fp32 constant per ``NF4_CONST_BLOCK`` of them."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        n, dev = linear.weight.numel(), linear.weight.device
        self.shape, self.compute_dtype = tuple(linear.weight.shape), compute_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.nn.Parameter(torch.empty((n + 1) // 2, dtype=torch.uint8, device=dev), requires_grad=False)
        blocks = -(-n // NF4_BLOCK)
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=dev))
        self.register_buffer("absmax_scale", torch.empty(-(-blocks // NF4_CONST_BLOCK), dtype=torch.float32, device=dev))
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight dequantized, as PEFT's DoRA reads it (``dequantize_module_weight``): a new tensor each time,
        allocated as bitsandbytes' dequantization allocates it."""
        return torch.empty(self.shape, dtype=self.compute_dtype, device=self.packed.device)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = _Dequantized4bitMatmul.apply(x, self.packed, self.shape, self.compute_dtype)
        return out + self.bias.to(out.dtype) if self.bias is not None else out


def quantize_base_4bit(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Swap the frozen linear layers inside the decoder blocks (what bitsandbytes quantizes: not the
    head) for 4-bit stand-ins, in place; returns how many were swapped."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if ".layers." not in f".{name}." and ".h." not in f".{name}.":
            continue
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and not child.weight.requires_grad:
                setattr(module, child_name, FourBitLinear(child, compute_dtype))
                swapped += 1
    return swapped
