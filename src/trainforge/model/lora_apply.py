"""LoRA adapters on a model through PEFT: what they adapt (``lora_targets.py``), and only layers whose adapter
weights PEFT's own load puts back where they trained (``adapter_keys.py``)."""

from __future__ import annotations

import re
import warnings

import torch

from ..config.run import ConfigError, LoraSettings
from .adapter_keys import reloaded_elsewhere
from .lora_experts import factor_expert_lora
from .lora_fused import fuse_lora_layers
from .lora_targets import lora_targets
from .multimodal import lora_exclusion

# model types whose layers are reversible (their custom backward recomputes each layer from its output): with the
# embeddings frozen, nothing entering them needs a gradient, so the loss had no grad_fn and LoRA could not train
REVERSIBLE = {"reformer"}


def apply_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """Wrap with PEFT LoRA adapters (DoRA / rank-stabilized scaling when asked); only the adapters train.

    Task type ``SEQ_2_SEQ_LM`` for encoder-decoder models (``final/`` then loads with
    ``AutoPeftModelForSeq2SeqLM``). ``all-linear`` adapts every linear layer but the LM head: on
    T5 ``q, k, v, o, wi (wi_0, wi_1), wo``, on BART ``q_proj, k_proj, v_proj, out_proj, fc1, fc2``,
    in the encoder, the decoder and its cross-attention alike. ``lora.fused``: the layers add their update
    inside the GEMM (``lora_fused.py``), the experts' adapters as factors (``lora_experts.py``).

    A layer whose saved adapter PEFT's load would put elsewhere (a model type whose checkpoint renamings also
    match adapter keys: Inkling 2's ``sconv.weight_proj`` becomes ``sconv.weight_proj.weight``) would train,
    then reload and merge without its update: ``all-linear`` leaves such layers out (``trainforge_lora_left_out``
    names them), and naming one is refused."""
    modules, parameters = lora_targets(model, lora.target_modules)  # MoE: the experts' 3-D weights as parameters
    excluded = lora_exclusion(model)  # an image-text model: adapters on its language model only
    peft_model = _wrap(model, lora, modules, parameters, excluded)
    lost = reloaded_elsewhere(peft_model)
    if lost and lora.target_modules != "all-linear":
        names = sorted({n.rsplit(".", 1)[-1] for n in lost})
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(names)}: PEFT's load renames this model type's adapter weights "
            f"of these layers ({len(lost)} in all, e.g. {lost[0]}) onto other names, so a saved adapter would reload "
            "and merge without their update; leave them out (all-linear leaves them out itself)")
    if lost:
        left_out = "|".join(re.escape(n) for n in lost)
        peft_model = _wrap(peft_model.unload(), lora, modules, parameters,
                           f"{excluded}|{left_out}" if excluded else left_out)
        peft_model.trainforge_lora_left_out = lost
    if getattr(model.config, "model_type", None) in REVERSIBLE:
        peft_model.get_base_model().enable_input_require_grads()
    if lora.fused:
        peft_model.trainforge_lora_fused = fuse_lora_layers(peft_model)  # the update added inside the GEMM (lora_fused.py)
        peft_model.trainforge_lora_experts = factor_expert_lora(peft_model)  # experts' LoRA as factors (lora_experts.py)
    return peft_model


def _wrap(model: torch.nn.Module, lora: LoraSettings, modules, parameters: list[str], excluded: str | None):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_dora=lora.use_dora, use_rslora=lora.use_rslora,
        target_modules=modules or None, target_parameters=parameters or None, exclude_modules=excluded,
        task_type="SEQ_2_SEQ_LM" if getattr(model.config, "is_encoder_decoder", False) else "CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)
