"""What LoRA adapts: ``model.lora.target_modules`` checked against the model, mixture-of-experts aware.

transformers 5 stores a MoE layer's routed experts as 3-D parameters (``experts.gate_up_proj``,
``experts.down_proj``): PEFT adapts them through ``target_parameters``, not ``target_modules``. Left to
itself, PEFT's ``all-linear`` maps a Mixtral or Qwen2-MoE to its pre-v5 layer names and puts adapters on the
router (``gate.weight``) too; here ``all-linear`` is every linear layer but the head and the routers, plus
the experts' projections, and a router is adapted only when named.

A router is found by its role: a linear layer beside an experts module (in the same MoE block) with one output per
expert, or one output in all (a shared expert's gate); ``gate`` / ``*_gate`` names elsewhere count too. A linear
layer whose model code gives it a forward that is not ``x W^T + b`` (Phi-MoE's and Llama 4's routers return their
top-k choice, DeepSeek-V4's grouped output projection multiplies per head group) cannot take LoRA's ``B A x``: it
is left out of ``all-linear``, and naming it is refused.
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
    """A routing linear layer by its name: Mixtral's or Qwen's ``gate``, Qwen2-MoE's ``shared_expert_gate``."""
    last = name.rsplit(".", 1)[-1]
    return last == "gate" or last.endswith("_gate")


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def routers(model: torch.nn.Module) -> set[str]:
    """Full names of the linear layers that route tokens, by their role: a child of an MoE block (the module
    holding an experts module) with one output per expert (the router) or a single output (a shared expert's
    gate)."""
    counts = {id(m): m.num_experts for m in expert_modules(model)}
    found = set()
    for name, block in model.named_modules():
        widths = {counts[id(c)] for c in block.children() if id(c) in counts}
        if not widths:
            continue
        for child_name, child in block.named_children():
            if isinstance(child, torch.nn.Linear) and child.out_features in widths | {1}:
                found.add(f"{name}.{child_name}" if name else child_name)
    return found


def _maps_like_linear(module: torch.nn.Linear) -> bool:
    """Whether the layer's forward takes (rows, in_features) to one tensor of (rows, out_features), as ``x W^T + b``
    does (checked once on zeros, without gradients, on the weight's device; the random state is restored, as a
    router may draw jitter noise)."""
    weight = module.weight
    x = torch.zeros(2, module.in_features, device=weight.device,
                    dtype=weight.dtype if weight.is_floating_point() else torch.float32)
    with torch.random.fork_rng(devices=[weight.device] if weight.is_cuda else []), torch.no_grad():
        try:
            out = module(x)
        except Exception:  # noqa: BLE001 -- a forward that cannot take (rows, in_features) is not a linear map
            return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, module.out_features)


def not_linear_maps(model: torch.nn.Module) -> dict[str, str]:
    """Full name -> class name of the linear layers whose model code overrides ``forward`` with something that is
    not a linear map of its input (a tuple, another shape). Quantized and FP8 layers (bitsandbytes, torchao,
    transformers' integrations) are not model code: they compute ``x W^T + b`` in their own kernels and PEFT
    handles them. One probe per class and shape."""
    probed: dict[tuple[type, int, int], bool] = {}
    found = {}
    for name, module in model.named_modules():
        cls = type(module)
        if (not isinstance(module, torch.nn.Linear) or cls.forward is torch.nn.Linear.forward
                or not cls.__module__.startswith("transformers.models.")):
            continue
        key = (cls, module.in_features, module.out_features)
        if key not in probed:
            probed[key] = _maps_like_linear(module)
        if not probed[key]:
            found[name] = cls.__name__
    return found


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
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)} - {HEAD})


def matching_suffixes(model: torch.nn.Module, wanted: set[str]) -> list[str]:
    """The shortest dotted name endings that, as PEFT matches ``target_modules`` (a module whose path is the name or
    ends with "." + it), pick the ``wanted`` modules and nothing else of the model: ``q_proj`` where every module so
    named is wanted, ``shared_expert.gate_proj`` where another ``gate_proj`` is not. Modules PEFT's
    ``exclude_modules`` keeps out anyway (an image-text model's towers) may match or not: their Sequential
    projector's ``0`` would otherwise pick the language model's ``layers.0``."""
    from .multimodal import non_text_parts

    skipped = tuple(non_text_parts(model))
    inside = tuple(f"{p}." for p in skipped)
    names = [n for n, _ in model.named_modules() if n and n not in skipped and not n.startswith(inside)]
    wanted = {n for n in wanted if n not in skipped and not n.startswith(inside)}
    unwanted = {e for n in names if n not in wanted for e in _endings(n)}  # what must match nothing wanted
    # the shortest ending no unwanted module has (the whole path where every ending is shared)
    return sorted({next((e for e in _endings(n) if e not in unwanted), n) for n in wanted})


def _endings(name: str) -> list[str]:
    """``a.b.c`` -> ``c``, ``b.c``, ``a.b.c``: the names PEFT's ``target_modules`` would match it by, shortest first."""
    parts = name.split(".")
    return [".".join(parts[-k:]) for k in range(1, len(parts) + 1)]


def lora_targets(model: torch.nn.Module, targets: str | list[str]) -> tuple[str | list[str], list[str]]:
    """(``target_modules``, ``target_parameters``) for PEFT. A single name is a list of one (PEFT would read a
    string as a regular expression over full module names, so ``q_proj`` matched nothing); a name that is an
    experts' parameter (``gate_up_proj``, ``experts.down_proj``) adapts those experts; a name that neither a
    module nor an experts' parameter ends with is refused, listing what the model has."""
    experts = expert_parameters(model)
    mamba = getattr(getattr(model, "config", None), "model_type", None) in PEFT_MAMBA_TYPES
    odd = not_linear_maps(model)
    if targets == "all-linear":
        if not experts and not mamba and not odd:
            return targets, []
        left_out = routers(model) | set(odd) if experts else set(odd)
        wanted = {n for n, m in model.named_modules() if _is_linear(m) and n not in left_out
                  and not (experts and _is_router(n)) and n.rsplit(".", 1)[-1] != HEAD
                  and not (mamba and n.rsplit(".", 1)[-1] in PEFT_MAMBA_REFUSED)}
        return matching_suffixes(model, wanted), experts
    targets = [targets] if isinstance(targets, str) else list(targets)
    refused = [t for t in targets if mamba and t.rsplit(".", 1)[-1] in PEFT_MAMBA_REFUSED]
    if refused:
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(refused)}: PEFT does not adapt {', '.join(sorted(PEFT_MAMBA_REFUSED))} "
            f"of a {model.config.model_type} model (its Mamba kernels read those weights directly); leave them out"
        )
    clash = {t: cls for t in targets for n, cls in odd.items() if n == t or n.endswith("." + t)}
    if clash:
        what = ", ".join(f"{t} ({cls})" for t, cls in sorted(clash.items()))
        raise ConfigError(
            f"model.lora.target_modules: {what}: the model's code gives this linear layer a forward that is not "
            "x W^T + b (a router returning its top-k choice, a projection per group of heads), so LoRA's B A x "
            "cannot be added to its output; leave it out"
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
