"""Per-document SDPA equals the stock masked SDPA on packed rows: outputs, gradients, generation."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainforge.model.packed_attention import register


def pair():
    name = register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # grouped-query
    stock = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    packed = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    packed.load_state_dict(stock.state_dict())
    return stock, packed


def test_same_logits_and_gradients_on_packed_rows():
    stock, packed = pair()
    ids = torch.randint(0, 300, (2, 40))
    pos = torch.tensor([list(range(10)) + list(range(25)) + list(range(5)), list(range(40))])
    a = stock(input_ids=ids, position_ids=pos, use_cache=False).logits
    b = packed(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), q in zip(stock.named_parameters(), packed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_generation_and_saved_config_are_stock(tmp_path):
    stock, packed = pair()
    prompt = torch.randint(0, 300, (1, 6))
    assert torch.equal(packed.generate(prompt, max_new_tokens=6, do_sample=False), stock.generate(prompt, max_new_tokens=6, do_sample=False))
    packed.save_pretrained(tmp_path)
    assert not any("attn" in k for k in json.loads((tmp_path / "config.json").read_text()))
    AutoModelForCausalLM.from_pretrained(tmp_path)  # loads anywhere, without trainforge
