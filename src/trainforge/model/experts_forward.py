"""The routed experts' computation, one skeleton for every way trainforge runs it.

transformers' experts interface (``@use_experts_implementation``: 3-D ``gate_up_proj`` / ``up_proj`` and
``down_proj`` weights, ``has_gate``, ``has_bias``, ``is_transposed``, ``_apply_gate``) computes: sort the
(token, expert) pairs by expert, gather their rows, project up, gate, project down, weight by the router, put the
rows back and sum each token's ``top_k``. ``routed_experts`` does exactly that with the projection left to the
caller, who gets the rows sorted by expert and their expert ids:

- ``trainforge_grouped`` (registered in transformers' ``ExpertsInterface``): the grouped GEMM transformers' own
  ``grouped_mm`` uses, plus a LoRA of the expert weights as two low-rank grouped GEMMs (``model/lora_experts.py``)
  instead of PEFT's ``W + B A`` over every expert of the layer at each forward;
- a plan's shape-static stand-in (``engine/predict/moe.py``): one ``bmm`` with every expert taking an equal share.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

GROUPED_NAME = "trainforge_grouped"
LORA_STASH = "_trainforge_lora"  # on an experts module during a LoRA forward: {weight name: (a, b, scaling)}
NF4_STASH = "_trainforge_nf4"  # on an experts module QLoRA quantized: {weight name: (packed bytes, QuantState)}

# project(rows sorted by expert, weight name, their expert ids) -> rows @ that expert's weight (no bias)
Project = Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor]


def routed_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   project: Project) -> torch.Tensor:
    """transformers' grouped experts forward with the projections done by ``project``: (tokens, hidden) out."""
    tokens, top_k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    routed = hidden_states[perm // top_k]  # (tokens x top_k, hidden), grouped by expert
    weights = top_k_weights.reshape(-1)[perm]
    up = "gate_up_proj" if self.has_gate else "up_proj"
    out = project(routed, up, expert_ids)
    if self.has_bias:
        out = out + getattr(self, f"{up}_bias")[expert_ids]
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = project(out, "down_proj", expert_ids)
    if self.has_bias:
        out = out + self.down_proj_bias[expert_ids]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    return out[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def lora_of(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The LoRA factors ``(a (experts, in, r), b (experts, r, out), scaling)`` set on ``module`` for its weight
    ``name`` during this forward, or None."""
    return (getattr(module, LORA_STASH, None) or {}).get(name)


def nf4_of(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, Any] | None:
    """``(packed 4-bit bytes, bitsandbytes QuantState)`` of the experts' weight ``name`` where QLoRA quantized it."""
    return (getattr(module, NF4_STASH, None) or {}).get(name)


class NF4GroupedMM(torch.autograd.Function):
    """``rows @ W_e`` per expert for a weight held in NF4: dequantized in forward and again in backward, so no
    dequantized copy of the layer's experts outlives the GEMM (autograd would keep it for backward). The frozen
    weight gets no gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, packed: torch.Tensor, state: Any, offsets: torch.Tensor, transposed: bool):
        ctx.state, ctx.transposed, ctx.rows_dtype = state, transposed, rows.dtype
        ctx.save_for_backward(packed, offsets)
        return _grouped_mm(rows, _dequantized(packed, state, transposed), offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        packed, offsets = ctx.saved_tensors
        weight = _dequantized(packed, ctx.state, ctx.transposed)  # (experts, in, out)
        grad_rows = _grouped_mm(grad, weight.transpose(-2, -1), offsets)
        return grad_rows.to(ctx.rows_dtype), None, None, None, None


def _dequantized(packed: torch.Tensor, state: Any, transposed: bool) -> torch.Tensor:
    """The weight as (experts, in, out), in its stored dtype."""
    import bitsandbytes.functional as bnbf

    weight = bnbf.dequantize_4bit(packed, state)
    return weight if transposed else weight.transpose(-2, -1)


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """transformers' grouped GEMM dispatch: ``torch._grouped_mm`` where it serves, its own loop of GEMMs elsewhere."""
    from transformers.integrations.moe import _grouped_mm as grouped

    return grouped(rows, weight, offsets)


def _offsets(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Each expert's end in the rows sorted by expert (int32, as the grouped GEMM takes them)."""
    # histc, as transformers counts them: bincount's output size depends on the data (no CUDA graphs); histc takes
    # floats only on CPU and ints only on CUDA under deterministic algorithms
    counts = torch.histc(expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids.int(),
                         bins=experts, min=0, max=experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


CAST_DEVICES = ("cuda",)  # where autocast's half-precision casts reach the grouped GEMM (tests add "cpu")


def autocast_to(rows: torch.Tensor) -> torch.dtype | None:
    """The half dtype the grouped GEMMs take under autocast on the rows' device, or None (no autocast there, or a
    CPU: its grouped GEMM multiplies fp32 weights in fp32, as transformers' does, faster than emulated bf16)."""
    device = rows.device.type
    if device in CAST_DEVICES and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts on transformers' grouped GEMM (``torch._grouped_mm`` where it serves, its own loop of GEMMs
    elsewhere), with a LoRA of the expert weights as ``scaling x (rows @ A_e) @ B_e`` per expert where one is set.

    Under CUDA autocast the GEMMs take autocast's dtype, as eager's per-expert ``linear`` would: fp32 master weights
    (a full fine-tune) are cast for the GEMM, which ``torch._grouped_mm`` then serves in bf16 (it takes no fp32, and
    it is no autocast op: without the cast a full fine-tune had to run the experts one ``linear`` at a time)."""
    offsets: list[torch.Tensor] = []

    def project(rows: torch.Tensor, name: str, expert_ids: torch.Tensor) -> torch.Tensor:
        if not offsets:
            offsets.append(_offsets(expert_ids, self.num_experts))
        half = autocast_to(rows)
        cast = (lambda t: t.to(half)) if half is not None else (lambda t: t)  # noqa: E731
        rows = cast(rows)
        nf4 = nf4_of(self, name)
        if nf4 is not None:  # QLoRA: the weight dequantized for this GEMM only, again in backward (nf4_experts.py)
            out = NF4GroupedMM.apply(rows, nf4[0], nf4[1], offsets[0], self.is_transposed)
        else:
            weight = cast(getattr(self, name))  # autocast's copy, kept for backward as linear's cast is
            out = _grouped_mm(rows, weight if self.is_transposed else weight.transpose(-2, -1), offsets[0])
        lora = lora_of(self, name)
        if lora is not None:
            a, b, scaling = lora
            # rank-r intermediates only: no expert-sized tensor is made, kept for backward or recomputed
            out = out + _grouped_mm(_grouped_mm(rows, cast(a), offsets[0]), cast(b), offsets[0]) * scaling
        return out

    return routed_experts(self, hidden_states, top_k_index, top_k_weights, project)


def register_grouped() -> str:
    """Make ``GROUPED_NAME`` an experts implementation transformers dispatches to (once); returns the name."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if GROUPED_NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(GROUPED_NAME, grouped_experts_forward)
    return GROUPED_NAME
