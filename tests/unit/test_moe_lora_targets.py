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


def test_routers_whose_forward_returns_their_choice_are_left_out_and_naming_one_is_exit_2():
    """Phi-MoE's and Llama 4's routers are linear layers whose forward returns (logits, weights, experts): PEFT's
    LoRA wrapped them (a tuple has no dtype). all-linear finds them by role (one output per expert, beside the
    experts) and leaves them out; the model then trains with LoRA; naming one is a ConfigError saying why."""
    from trainforge.config.run import LoraSettings
    from trainforge.model.load import apply_lora
    from trainforge.model.lora_targets import routers

    for arch, fields in (("phimoe", {"num_local_experts": 4}), ("llama4_text", {"num_local_experts": 4, "head_dim": 8})):
        model = build(arch, **fields)
        found = routers(model)
        assert found and all(name.endswith(".router") for name in found)
        modules, params = lora_targets(model, "all-linear")
        assert "router" not in modules and {"q_proj", "o_proj"} <= set(modules) and params
        with pytest.raises(ConfigError, match=r"router \((PhimoeTopKRouter|Llama4Router)\).*not x W\^T \+ b"):
            lora_targets(model, ["q_proj", "router"])
        torch.manual_seed(0)
        peft = apply_lora(model, LoraSettings(r=4, alpha=8))
        ids = torch.randint(0, 64, (2, 6))
        peft(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for n, p in peft.named_parameters() if p.requires_grad and "lora_" in n)


def test_a_linear_layer_computing_per_group_is_left_out():
    """DeepSeek-V4's grouped output projection (``o_a_proj``) is an nn.Linear whose forward multiplies each group of
    heads by its own block: LoRA's B A x had the width of the whole layer (8192 against 1024 at its real size)."""
    from transformers import AutoModelForCausalLM

    from trainforge.model.lora_targets import not_linear_maps
    from trainforge.tools.family_shrink import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v4", 64))
    odd = not_linear_maps(model)
    assert odd and all(n.endswith("o_a_proj") and cls == "DeepseekV4GroupedLinear" for n, cls in odd.items())
    modules, _ = lora_targets(model, "all-linear")
    assert "o_a_proj" not in modules and "o_b_proj" in modules


def test_a_linear_subclass_computing_x_w_plus_b_stays_in_all_linear():
    """Falcon's layers override forward with the same x W^T + b: a dense model's all-linear is still PEFT's."""
    from transformers import AutoModelForCausalLM, FalconConfig

    from trainforge.model.lora_targets import not_linear_maps

    model = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=4))
    assert not_linear_maps(model) == {}
    assert lora_targets(model, "all-linear") == ("all-linear", [])


def test_all_linear_on_an_image_text_moe_never_names_a_towers_sequential_index():
    """dots.3-note: its towers' projectors are Sequentials (``proj.0``, ``proj.2``); all-linear named their linear
    layers by their last component, ``0`` and ``2``, which PEFT matched to the language model's ``layers.0`` too
    (ValueError: Target module ...DecoderLayer is not supported). Names are now the shortest endings that pick the
    wanted layers alone, and the towers (kept out by exclude_modules) are not named at all."""
    from trainforge.config.run import LoraSettings
    from trainforge.model.load import apply_lora

    text = build("qwen3_moe", num_experts=4, moe_intermediate_size=16)
    inner = torch.nn.Module()
    inner.language_model = text.model
    inner.visual = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    wrapper = torch.nn.Module()
    wrapper.model, wrapper.lm_head, wrapper.config = inner, text.lm_head, text.config
    modules, params = lora_targets(wrapper, "all-linear")
    assert modules == ["k_proj", "o_proj", "q_proj", "v_proj"] and params == ["experts.down_proj", "experts.gate_up_proj"]
    assert non_text_parts(wrapper) == ["model.visual"]

    peft = apply_lora(text, LoraSettings(r=4, alpha=8))  # the names PEFT gets adapt what they say
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in peft.named_modules() if n.endswith(".lora_A")}
    # attention by name, the experts through target_parameters (PEFT's wrapper of their 3-D weights)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj", "experts", "base_layer"}


def test_a_name_shared_with_a_layer_left_out_is_made_longer_not_dropped():
    from trainforge.model.lora_targets import matching_suffixes

    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.gate_proj, model.mlp.router = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    model.shared = torch.nn.Module()
    model.shared.gate_proj = torch.nn.Linear(4, 4)
    assert matching_suffixes(model, {"mlp.gate_proj", "shared.gate_proj"}) == ["gate_proj"]
    assert matching_suffixes(model, {"shared.gate_proj"}) == ["shared.gate_proj"]
    assert matching_suffixes(model, {"mlp.router"}) == ["router"]
