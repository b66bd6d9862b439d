"""FLOPs per token of mixture-of-experts models count the experts a token runs through (top-k of the routed
ones, every shared expert and the router), not every expert: exact numbers for four families."""

from __future__ import annotations

import pytest
import torch

from trainforge.metrics.flops import flops_per_token, linear_params

H, V, L, HEADS, KV, E, K = 32, 64, 2, 4, 2, 8, 2
D = H // HEADS
ATTENTION = 2 * H * HEADS * D + 2 * H * KV * D  # q and o, k and v
ROUTER = E * H


def build(arch: str, **fields) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    base = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=KV,
                num_experts_per_tok=K, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[arch](**base, **fields))


@pytest.mark.parametrize("arch, fields, per_layer", [
    ("qwen3_moe", dict(num_experts=E, moe_intermediate_size=16, intermediate_size=48), ATTENTION + ROUTER + K * 3 * H * 16),
    ("olmoe", dict(num_experts=E, intermediate_size=16), ATTENTION + ROUTER + K * 3 * H * 16),
    ("mixtral", dict(num_local_experts=E, intermediate_size=16), ATTENTION + ROUTER + K * 3 * H * 16),
    # Qwen2-MoE: the shared expert (intermediate 24) and its sigmoid gate run for every token
    ("qwen2_moe", dict(num_experts=E, moe_intermediate_size=16, shared_expert_intermediate_size=24, intermediate_size=48),
     ATTENTION + ROUTER + K * 3 * H * 16 + 3 * H * 24 + H),
])
def test_active_parameters_per_token(arch, fields, per_layer):
    model = build(arch, **fields)
    active = L * per_layer + V * H  # + the LM head; embeddings excluded
    assert linear_params(model) == (active, 0)
    attention = 2 * 2 * L * H * 64 * 3
    assert flops_per_token(model, 64) == 6 * active + attention
    every_expert = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 3)
    assert every_expert == L * E * 3 * H * 16  # all of them are held: the count above is the routed share


def test_frozen_experts_count_their_routed_share_without_weight_gradients():
    model = build("qwen3_moe", num_experts=E, moe_intermediate_size=16, intermediate_size=48)
    for n, p in model.named_parameters():
        p.requires_grad_("experts" not in n)
    trained, frozen = linear_params(model)
    assert frozen == L * K * 3 * H * 16
    assert trained == L * (ATTENTION + ROUTER) + V * H
