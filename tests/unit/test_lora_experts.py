"""LoRA of the routed experts as factors (model/lora_experts.py): the same logits and gradients as PEFT's own
``W + B A`` forward, without any expert-sized tensor made or kept for backward."""

from __future__ import annotations

import pytest
import torch

from trainforge.config.run import LoraSettings
from trainforge.model.experts_forward import GROUPED_NAME
from trainforge.model.load import apply_lora

FAMILIES = {  # (model_type, fields): a concatenated gate/up (Qwen3-MoE, Mixtral), GPT-OSS's transposed, biased,
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),  # interleaved and clamped experts
    "mixtral": dict(num_local_experts=4),
    "gpt_oss": dict(num_local_experts=4, head_dim=8, layer_types=["full_attention", "sliding_attention"], sliding_window=8),
}


def tiny(arch: str) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    config = CONFIG_MAPPING[arch](vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, **FAMILIES[arch])
    model = AutoModelForCausalLM.from_config(config)
    model.set_experts_implementation("grouped_mm")
    return model


def adapted(arch: str, fused: bool) -> torch.nn.Module:
    model = apply_lora(tiny(arch), LoraSettings(r=4, alpha=8, fused=fused))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at zero: the update (and A's gradient) would vanish on both paths
                p.normal_(std=0.05)
    return model


def logits_and_grads(model: torch.nn.Module, ids: torch.Tensor, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().square().mean().backward()
    return logits.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_factored_expert_lora_equals_peft(arch):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    factored, peft = adapted(arch, fused=True), adapted(arch, fused=False)
    assert factored.trainforge_lora_experts == 4  # gate_up_proj and down_proj in each of 2 layers
    assert factored.base_model.model.config._experts_implementation == GROUPED_NAME
    assert_same_function(factored, peft, ids)


def assert_same_function(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor) -> None:
    """fp32 logits (1e-5) and every gradient (1e-4 relative) of ``model`` equal ``reference``'s, experts' adapters among them."""
    want, want_grads = logits_and_grads(reference, ids)
    got, got_grads = logits_and_grads(model, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys() and any(".experts." in n for n in got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_factored_expert_lora_under_bf16_autocast_is_as_close_to_fp32_as_peft():
    """What a LoRA run trains: a bf16 frozen base, fp32 adapters, bf16 autocast (r = 4: bf16 rows of 8 bytes, padded
    for the grouped GEMM). One experts layer on fixed routing (in a whole model, rounding flips near-tie routing
    in later layers, either way): output, input gradient and adapter gradients against fp32 on the same weights,
    no further off than PEFT's own forward."""
    torch.manual_seed(5)
    hidden, grad = torch.randn(24, 32), torch.randn(24, 32)
    index, weights = torch.stack([torch.randperm(4)[:2] for _ in range(24)]), torch.rand(24, 2)
    runs = {}
    for fused, half in ((True, True), (False, True), (False, False)):
        model = adapted("qwen3_moe", fused)
        for n, p in model.named_parameters():
            if "lora_" not in n:  # bf16 weights; the fp32 reference computes on the same (rounded) values
                p.data = p.data.bfloat16() if half else p.data.bfloat16().float()
        experts = model.base_model.model.model.layers[0].mlp.experts
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            out = experts(h, index, weights)
        out.float().backward(grad)
        runs[fused, half] = [out.detach().float(), h.grad] + [p.grad for n, p in sorted(experts.named_parameters()) if p.grad is not None]
    ref = runs[False, False]
    for got, peft, want in zip(runs[True, True], runs[False, True], ref):
        error = lambda t: float((t.float() - want).norm() / want.norm())  # noqa: E731
        assert error(got) <= 2 * error(peft) + 1e-3, (error(got), error(peft))


def test_no_expert_sized_tensor_is_kept_for_backward():
    """PEFT's forward keeps W + B A (every expert of the layer) for backward; the factored one keeps the weights
    themselves and rank-r rows only."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    for fused, expect_copy in ((True, False), (False, True)):
        model = adapted("qwen3_moe", fused)
        weights = {p.data_ptr(): p.shape for n, p in model.named_parameters() if p.ndim == 3}
        copies = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.shape in weights.values() and t.data_ptr() not in weights:
                copies.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert bool(copies) == expect_copy, copies


def test_a_merged_or_other_implementation_runs_peft_forward():
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    model = adapted("qwen3_moe", fused=True)
    model.eval()
    with torch.no_grad():
        factored = model(input_ids=ids, use_cache=False).logits
        model.base_model.model.set_experts_implementation("eager")  # the factors are not read there: PEFT's W + B A
        eager = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(eager, factored, atol=1e-5, rtol=1e-5)
