"""LoRA targets of mixture-of-experts models: all-linear adapts the experts' 3-D weights and leaves the routers out."""

from __future__ import annotations

import pytest
import torch

from trainforge.config.run import ConfigError
from trainforge.model.lora_targets import lora_targets
from trainforge.model.multimodal import lora_exclusion, non_text_parts


def build(arch: str, **fields):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch](**base, **fields))


def test_all_linear_on_mixtral_is_attention_and_experts_without_router():
    modules, params = lora_targets(build("mixtral", num_local_experts=4), "all-linear")
    assert modules == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert params == ["experts.down_proj", "experts.gate_up_proj"]


def test_all_linear_on_qwen2_moe_adapts_the_shared_expert_not_its_gate():
    model = build("qwen2_moe", num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    modules, params = lora_targets(model, "all-linear")
    assert {"gate_proj", "up_proj", "down_proj"} <= set(modules)  # the shared expert's projections
    assert "shared_expert_gate" not in modules and "gate" not in modules
    assert params == ["experts.down_proj", "experts.gate_up_proj"]


def test_named_expert_weights_and_a_name_matching_nothing():
    model = build("qwen3_moe", num_experts=4, moe_intermediate_size=16)
    assert lora_targets(model, ["q_proj", "gate_up_proj"]) == (["q_proj"], ["experts.gate_up_proj"])
    with pytest.raises(ConfigError, match=r"w1 names no module.*experts' weights are experts.down_proj, experts.gate_up_proj"):
        lora_targets(model, ["w1"])


def test_dense_all_linear_is_left_to_peft_and_text_models_exclude_nothing():
    model = build("llama")
    assert lora_targets(model, "all-linear") == ("all-linear", [])
    assert non_text_parts(model) == [] and lora_exclusion(model) is None


def test_all_linear_on_mamba_leaves_out_what_peft_refuses_and_naming_it_is_exit_2():
    """PEFT refuses LoRA on a Mamba's out_proj and conv1d (its kernels read them directly): all-linear adapts the
    other projections; naming one is a ConfigError that says so (a PEFT ValueError traceback before)."""
    from transformers import AutoModelForCausalLM, MambaConfig

    model = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4))
    modules, params = lora_targets(model, "all-linear")
    assert "out_proj" not in modules and "conv1d" not in modules and {"in_proj", "x_proj", "dt_proj"} <= set(modules)
    assert params == []
    with pytest.raises(ConfigError, match="out_proj.*Mamba kernels"):
        lora_targets(model, ["in_proj", "out_proj"])
