"""A saved LoRA adapter whose weights PEFT loads back onto the modules that trained them.

transformers 5 renames a checkpoint's keys on load for some model types (``conversion_mapping.py``: older layouts
to the current module names), and PEFT applies the same renamings to an adapter's keys when it loads one, while
its ``save_pretrained`` writes them under the module names as they are. Where a renaming also matches the current
name, the round trip moves weights elsewhere: Laguna's ``mlp.shared_expert.`` -> ``mlp.shared_experts.`` is a
regular expression whose ``.`` matches the ``s`` of ``shared_experts``, so PEFT loaded the shared experts' adapters
as ``shared_experts..gate_proj`` (dropped, silently: the reloaded and merged model lost them). Here the written
adapter's keys are checked against PEFT's own load-time conversion; a key it would move is written in its
checkpoint form (transformers' renamings undone, as its ``save_pretrained`` does for a full model), kept only
where PEFT's conversion then gives back every key unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..hf_dir import readable_like_config

ADAPTER_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's serialized keys: the base model's keys under this prefix


def _as_peft_loads(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (an adapter file's tensors) as PEFT's load converts it for ``model`` (a PeftModel), before it
    assigns the tensors to modules."""
    from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers

    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    return convert_peft_adapter_state_dict_for_transformers(model, model.peft_config[name], dict(state), name)


def _checkpoint_form(model: torch.nn.Module, key: str) -> str:
    """``key`` with the model type's checkpoint renamings undone, the last one first."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    inner = key.removeprefix(PREFIX)
    for transform in reversed(get_model_conversion_mapping(model.get_base_model())):
        if isinstance(transform, WeightRenaming):
            inner, _ = transform.reverse_transform().rename_source_key(inner)
    return PREFIX + inner


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _round_trip(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], dict, dict]:
    """(the keys of ``state`` PEFT's load would move, ``state`` with those keys in their checkpoint form, what PEFT's
    load makes of that form); no keys, ``state`` and its load where nothing moves."""
    loaded = _as_peft_loads(model, state)
    if _same(loaded, state):
        return [], state, loaded
    moved = sorted(k for k in state if k not in loaded or not torch.equal(loaded[k], state[k]))
    rewritten = {(_checkpoint_form(model, k) if k in moved else k): v for k, v in state.items()}
    return moved, rewritten, _as_peft_loads(model, rewritten)


def keep_adapter_keys(model: torch.nn.Module, directory: Path) -> list[str]:
    """Rewrite ``directory``'s adapter file (just written by ``model.save_pretrained``) so that PEFT's load puts
    every weight back on its module. Returns the keys PEFT would still move (empty when all load right)."""
    from safetensors.torch import load_file, save_file

    path = Path(directory) / ADAPTER_FILE
    if not path.is_file() or not hasattr(model, "peft_config"):
        return []
    state = load_file(str(path))
    moved, rewritten, back = _round_trip(model, state)
    if not moved:
        return []
    if not _same(back, state):
        return moved
    save_file(rewritten, str(path), metadata={"format": "pt"})
    return []


def reloaded_elsewhere(model: torch.nn.Module) -> list[str]:
    """Names (as the base model names them) of the adapted layers whose weights PEFT's load would put elsewhere even
    in their checkpoint form: what ``keep_adapter_keys`` cannot save. Empty for most model types."""
    from peft import get_peft_model_state_dict
    from torch._subclasses.fake_tensor import is_fake

    if not hasattr(model, "peft_config"):
        return []
    state = get_peft_model_state_dict(model)
    if any(t.is_meta or is_fake(t) for t in state.values()):  # a plan's skeleton: nothing is saved, nothing to compare
        return []
    _, _, back = _round_trip(model, state)
    lost = {k for k in state if k not in back or not torch.equal(back[k], state[k])}
    return sorted({k.removeprefix(PREFIX).split(".lora_", 1)[0] for k in lost})


def save_model(model: torch.nn.Module, directory: Path, state_dict: dict | None, warn: Callable[[str], None]) -> None:
    """``model.save_pretrained`` (with ``state_dict`` where given: FSDP's gathered weights), the weight files made
    as readable as config.json (transformers writes them 0600), an adapter's keys as PEFT loads them back (or a
    warning naming those it would move)."""
    model.save_pretrained(directory, **({"state_dict": state_dict} if state_dict is not None else {}))
    moved = keep_adapter_keys(model, directory)
    readable_like_config(Path(directory))
    if moved:
        warn(f"PEFT's load renames {len(moved)} adapter weights of {Path(directory).name}/ to modules that do not hold "
             f"them (transformers' checkpoint renamings for this model type), e.g. {moved[0]}: a reload or "
             "export --merge would leave them out")
