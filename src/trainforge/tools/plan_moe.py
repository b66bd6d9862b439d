"""What `trainforge plan` says about a mixture-of-experts model: its parameters (all held, the active ones per
token), its routed experts' weights and their dtype, the experts implementation the run would use, and why a
QLoRA of it stays large (bitsandbytes quantizes ``nn.Linear`` layers only, not transformers' 3-D expert weights).

Counts come from the model built on the meta device at full depth (shapes only: nothing is allocated).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.run import RunConfig
from ..hardware.device import Precision
from ..hardware.profiles import GIB, HardwareProfile
from ..metrics.flops import linear_params
from ..model.experts_impl import choose
from ..model.moe import expert_modules, routing


def moe_facts(cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile) -> dict[str, Any] | None:
    """Parameters of the base model (all of them, and the active ones a token runs through: top-k of the routed
    experts, everything else in full, embeddings included), its routed experts (count, per token, parameters,
    bytes in their stored dtype) and the experts implementation the run would use on ``profile``; None for a
    dense model."""
    from ..model.load import build_model_skeleton, storage_dtype
    from ..model.nf4_experts import nf4_bytes

    base = build_model_skeleton(cfg.model.model_copy(update={"method": "full"}), tokenizer, None, False)
    found = routing(getattr(base, "config", None))
    experts = [p for m in expert_modules(base) for p in m.parameters(recurse=False) if p.ndim == 3]
    if found is None or not experts:
        return None
    # the dtype the run stores the experts in: a LoRA base in the compute dtype, a full fine-tune's fp32 masters
    # (model.init builds fp32); QLoRA in NF4 (model/nf4_experts.py), computed on trainforge's grouped path
    dtype = torch.float32 if cfg.model.init is not None else storage_dtype(cfg.model, precision.autocast_dtype)
    implementation, why = choose(cfg.model.experts_implementation, "cpu" if profile.kind == "cpu" else "cuda", dtype,
                                 autocast_dtype=precision.autocast_dtype)
    embeddings = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Embedding))
    expert_params = sum(p.numel() for p in experts)
    facts = {
        "experts": found[1], "experts_per_token": found[2],
        "total_parameters": sum(p.numel() for p in base.parameters()),
        "active_parameters": int(sum(linear_params(base)) + embeddings),
        "expert_parameters": expert_params,
        "expert_bytes": expert_params * dtype.itemsize, "expert_dtype": str(dtype).removeprefix("torch."),
        "experts_implementation": implementation, "experts_implementation_why": why,
    }
    if cfg.model.method == "qlora":
        facts.update(expert_bytes=sum(nf4_bytes(p.numel()) for p in experts), expert_dtype="nf4")
    return facts


def with_moe(plan: dict[str, Any], cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile) -> dict[str, Any]:
    """``plan`` with ``moe`` (``moe_facts``; None for a dense model) and, for an MoE model, two decision rows:
    the parameters held and active, and the experts implementation."""
    facts = moe_facts(cfg, tokenizer, precision, profile)
    plan["moe"] = facts
    if facts is not None:
        plan["decisions"] = [*plan["decisions"], *moe_decisions(facts)]
    return plan


def moe_decisions(facts: dict[str, Any]) -> list[dict[str, str]]:
    """The plan's decisions rows of an MoE model: what it holds and runs per token, and how its experts run."""
    return [
        {"setting": "mixture of experts",
         "choice": f"{facts['total_parameters'] / 1e9:.2f}B held, {facts['active_parameters'] / 1e9:.2f}B active",
         "why": f"{facts['experts_per_token']} of {facts['experts']} routed experts per token; the experts' weights "
         f"{facts['expert_bytes'] / GIB:.1f} GiB in {facts['expert_dtype']}: memory holds all of them, time counts "
         "the active parameters"},
        {"setting": "experts_implementation", "choice": facts["experts_implementation"],
         "why": facts["experts_implementation_why"]},
    ]


def no_fit_fix(facts: dict[str, Any] | None, capacity: int) -> str | None:
    """The fix of a run no single change fits, where the routed experts alone are past the device's memory."""
    if facts is None or facts["expert_bytes"] < capacity:
        return None
    return (f"the routed experts alone are {facts['expert_bytes'] / GIB:.1f} GiB in {facts['expert_dtype']}, more than "
            f"the {capacity / GIB:.1f} GiB of the device: a GPU with more memory, or "
            "several with train.distributed: fsdp (plan --nproc N)")
