"""What LoRA adapts: ``model.lora.target_modules`` checked against the model, mixture-of-experts aware.

transformers 5 stores a MoE layer's routed experts as 3-D parameters (``experts.gate_up_proj``,
``experts.down_proj``): PEFT adapts them through ``target_parameters``, not ``target_modules``. Left to
itself, PEFT's ``all-linear`` maps a Mixtral or Qwen2-MoE to its pre-v5 layer names and puts adapters on the
router (``gate.weight``) too; here ``all-linear`` is every linear layer but the head and the routers, plus
the experts' projections, and a router is adapted only when named.
"""

from __future__ import annotations

import torch

from ..config.run import ConfigError
from .moe import expert_modules

HEAD = "lm_head"
# PEFT refuses LoRA on these modules of the model types whose Mamba kernels read the weights directly
# (peft/tuners/tuners_utils.py): all-linear leaves them out there, naming one is refused
PEFT_MAMBA_TYPES = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}
PEFT_MAMBA_REFUSED = {"out_proj", "conv1d"}


def _is_router(name: str) -> bool:
    """A routing linear layer: Mixtral's or Qwen's ``gate``, Qwen2-MoE's ``shared_expert_gate``."""
    last = name.rsplit(".", 1)[-1]
    return last == "gate" or last.endswith("_gate")


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """``experts.gate_up_proj``-style names (the experts module's own name and its 3-D parameter) of the model."""
    names = set()
    experts = {id(m) for m in expert_modules(model)}
    for name, module in model.named_modules():
        if id(module) in experts:
            owner = name.rsplit(".", 1)[-1]
            names |= {f"{owner}.{p}" for p, t in module.named_parameters(recurse=False) if t.ndim == 3}
    return sorted(names)


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of each linear layer (and GPT-2's Conv1D) but the head."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"} - {HEAD})


def lora_targets(model: torch.nn.Module, targets: str | list[str]) -> tuple[str | list[str], list[str]]:
    """(``target_modules``, ``target_parameters``) for PEFT. A single name is a list of one (PEFT would read a
    string as a regular expression over full module names, so ``q_proj`` matched nothing); a name that is an
    experts' parameter (``gate_up_proj``, ``experts.down_proj``) adapts those experts; a name that neither a
    module nor an experts' parameter ends with is refused, listing what the model has."""
    experts = expert_parameters(model)
    mamba = getattr(getattr(model, "config", None), "model_type", None) in PEFT_MAMBA_TYPES
    if targets == "all-linear":
        if not experts and not mamba:
            return targets, []
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                 if (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D") and not _is_router(n)}
        return sorted(names - {HEAD} - (PEFT_MAMBA_REFUSED if mamba else set())), experts
    targets = [targets] if isinstance(targets, str) else list(targets)
    refused = [t for t in targets if mamba and t.rsplit(".", 1)[-1] in PEFT_MAMBA_REFUSED]
    if refused:
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(refused)}: PEFT does not adapt {', '.join(sorted(PEFT_MAMBA_REFUSED))} "
            f"of a {model.config.model_type} model (its Mamba kernels read those weights directly); leave them out"
        )
    names = [name for name, _ in model.named_modules()]
    params = [e for t in targets for e in experts if e == t or e.endswith("." + t)]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)
               and not any(e == t or e.endswith("." + t) for e in experts)]
    if missing:
        extra = f"; its experts' weights are {', '.join(experts)}" if experts else ""
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(missing)} names no module of this model; its linear layers are "
            f"{', '.join(linear_names(model))}{extra} (or use all-linear)"
        )
    modules = [t for t in targets if not any(e == t or e.endswith("." + t) for e in experts)]
    return modules, sorted(set(params))
