"""A LoRA adapter's keys as PEFT loads them back (``model/adapter_keys.py``): transformers' checkpoint renaming for
Laguna (``mlp.shared_expert.`` -> ``mlp.shared_experts.``, a pattern that also matches the new name) made PEFT load
the shared experts' adapters under names no module has, so final/ reloaded, and export --merge merged, without them."""

from __future__ import annotations

import pytest
import torch

from trainforge.config.run import LoraSettings
from trainforge.model.adapter_keys import keep_adapter_keys, save_model
from trainforge.model.load import apply_lora


def tiny(arch: str, **fields):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[arch](vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
                                  **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def trained_adapter(model):
    peft = apply_lora(model, LoraSettings(r=4, alpha=8))
    with torch.no_grad():  # as if trained: every adapter weight away from its initial value
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return peft


def reloaded_adapter(base_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def test_laguna_shared_expert_adapters_load_back(tmp_path):
    model = tiny("laguna", num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    model.save_pretrained(tmp_path / "base")
    peft = trained_adapter(model)
    peft.save_pretrained(tmp_path / "plain")  # PEFT's own save: the shared experts' adapters do not load back
    with pytest.warns(UserWarning, match="missing adapter keys"):
        plain = lora_weights(reloaded_adapter(tmp_path / "base", tmp_path / "plain"))
    lost = [k for k, v in lora_weights(peft).items() if not torch.equal(plain[k], v)]
    assert lost and all(".shared_experts." in k for k in lost)

    warned = []
    save_model(peft, tmp_path / "kept", None, warned.append)
    kept = lora_weights(reloaded_adapter(tmp_path / "base", tmp_path / "kept"))
    assert not warned
    assert all(torch.equal(kept[k], v) for k, v in lora_weights(peft).items())


def test_an_adapter_peft_loads_back_as_saved_is_left_as_written(tmp_path):
    peft = trained_adapter(tiny("mixtral", num_local_experts=4))
    peft.save_pretrained(tmp_path)
    before = (tmp_path / "adapter_model.safetensors").read_bytes()
    assert keep_adapter_keys(peft, tmp_path) == []
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == before


def test_layers_whose_adapters_peft_reloads_elsewhere_are_left_out_of_all_linear_and_refused_by_name(tmp_path):
    """Inkling 2's checkpoint renaming ``(convolution|sconv).weight_proj`` -> ``.weight_proj.weight`` also matches the
    adapter key ``sconv.weight_proj.lora_A.weight``, and no checkpoint form escapes it: those adapters trained, then
    reloaded (and merged by export) as fresh ones. all-linear now leaves those layers out, so what trains is what
    reloads; naming them is a ConfigError."""
    from trainforge.config.run import ConfigError
    from trainforge.tools.family_shrink import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("inkling2_text", 64, {}))
    model.save_pretrained(tmp_path / "base")
    peft = trained_adapter(model)
    assert peft.trainforge_lora_left_out and all(n.endswith("sconv.weight_proj") for n in peft.trainforge_lora_left_out)
    assert not any("sconv.weight_proj.lora_" in k for k in lora_weights(peft))
    assert any(".linear.lora_A" in k for k in lora_weights(peft))  # the rest is adapted
    warned = []
    save_model(peft, tmp_path / "adapter", None, warned.append)
    back = lora_weights(reloaded_adapter(tmp_path / "base", tmp_path / "adapter"))
    assert not warned and all(torch.equal(back[k], v) for k, v in lora_weights(peft).items())

    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match="weight_proj: PEFT's load renames"):
        apply_lora(fresh, LoraSettings(r=4, alpha=8, target_modules=["linear", "weight_proj"]))
