"""Mixture-of-experts facts: routing fields of a config, the expert modules of a model, their active share.

transformers 5 stores a layer's routed experts as 3-D parameters (experts x out x in) in one module
(``Qwen3MoeExperts``, ``MixtralExperts``, ...); a token runs through ``top_k`` of them. Shared experts
(Qwen2-MoE) and the router are ordinary linear layers every token runs through.
Imports nothing from the rest of trainforge: the config validators use it too.
"""

from __future__ import annotations

from typing import Any

import torch

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen/OLMoE, Mixtral, DeepSeek
TOP_K_KEY = "num_experts_per_tok"


def _field(fields: Any, key: str) -> Any:
    return fields.get(key) if isinstance(fields, dict) else getattr(fields, key, None)


def routing(fields: Any) -> tuple[str, int, int] | None:
    """(the key naming the expert count, experts, experts per token) of a config (a dict or a transformers
    config; a multimodal one's ``text_config``), or None for a dense model."""
    text = _field(fields, "text_config")
    if text is not None and routing(text) is not None:
        return routing(text)
    top_k = _field(fields, TOP_K_KEY)
    # a dict's own order first: the key a user wrote, before the alias its config class adds
    keys = [k for k in fields if k in EXPERT_COUNT_KEYS] if isinstance(fields, dict) else EXPERT_COUNT_KEYS
    for key in keys:
        n = _field(fields, key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0 and isinstance(top_k, int):
            return key, n, top_k
    return None


def routing_problem(fields: Any) -> str | None:
    """Why a config's routing cannot run (each token's experts out of the layer's experts), naming the keys;
    None when it can or the model is dense."""
    found = routing(fields)
    if found is None:
        return None
    key, n, top_k = found
    if top_k < 1:
        return f"{TOP_K_KEY} is {top_k}: each token needs at least 1 expert"
    if top_k > n:
        return (f"{TOP_K_KEY} ({top_k}) is more than {key} ({n}): each token is routed to {TOP_K_KEY} distinct "
                f"experts out of {key}; lower {TOP_K_KEY} to at most {n}, or raise {key}")
    return None


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding routed experts as 3-D parameters (one per MoE layer)."""
    return [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
            and any(p.ndim == 3 for p in m.parameters(recurse=False))]


def top_k_of(model: torch.nn.Module) -> int | None:
    """Experts per token of the model (its text model's, for a multimodal one); None for a dense model."""
    config = getattr(model, "config", None)
    found = routing(config) if config is not None else None
    return found[2] if found else None


def active_share(model: torch.nn.Module) -> dict[int, float]:
    """id(parameter) -> the share of it one token runs through, for routed experts' parameters (top_k / experts);
    parameters not listed run in full."""
    top_k = top_k_of(model)
    if top_k is None:
        return {}
    return {id(p): min(1.0, top_k / m.num_experts) for m in expert_modules(model)
            for p in m.parameters(recurse=False) if p.ndim == 3}


def describe(model: torch.nn.Module) -> str | None:
    """'N experts, top-k per token in L layers' for the console, or None for a dense model."""
    mods = expert_modules(model)
    top_k = top_k_of(model)
    if not mods or top_k is None:
        return None
    return f"{mods[0].num_experts} experts, top-{top_k} per token, in {len(mods)} layers"
