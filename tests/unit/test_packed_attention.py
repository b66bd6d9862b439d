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


def assert_same_logits_and_gradients(stock, packed, ids, pos) -> None:
    a = stock(input_ids=ids, position_ids=pos, use_cache=False).logits
    b = packed(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), q in zip(stock.named_parameters(), packed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_same_logits_and_gradients_on_packed_rows():
    stock, packed = pair()
    ids = torch.randint(0, 300, (2, 40))
    pos = torch.tensor([list(range(10)) + list(range(25)) + list(range(5)), list(range(40))])
    assert_same_logits_and_gradients(stock, packed, ids, pos)


def test_generation_and_saved_config_are_stock(tmp_path):
    stock, packed = pair()
    prompt = torch.randint(0, 300, (1, 6))
    assert torch.equal(packed.generate(prompt, max_new_tokens=6, do_sample=False), stock.generate(prompt, max_new_tokens=6, do_sample=False))
    packed.save_pretrained(tmp_path)
    assert not any("attn" in k for k in json.loads((tmp_path / "config.json").read_text()))
    AutoModelForCausalLM.from_pretrained(tmp_path)  # loads anywhere, without trainforge


def test_many_documents_of_mixed_lengths_across_rows():
    """Several length buckets, documents of one token, a padding tail: outputs and gradients equal
    the stock block-diagonal masked SDPA."""
    stock, packed = pair()
    gen = torch.Generator().manual_seed(1)
    lengths = [[1, 7, 8, 2, 30, 16], [64], [33, 31], [5] * 12 + [4]]
    pos = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    ids = torch.randint(0, 300, pos.shape, generator=gen)
    assert_same_logits_and_gradients(stock, packed, ids, pos)


def test_documents_attend_only_to_themselves():
    """Changing one document's tokens changes no other document's outputs."""
    _, packed = pair()
    pos = torch.tensor([list(range(9)) + list(range(14)) + list(range(9))])
    ids = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(2))
    edited = ids.clone()
    edited[0, 9:23] = (edited[0, 9:23] + 1) % 300
    with torch.no_grad():
        a = packed(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = packed(input_ids=edited, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(a[0, :9], b[0, :9], rtol=0, atol=0)
    torch.testing.assert_close(a[0, 23:], b[0, 23:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[0, 9:23], b[0, 9:23])


def test_low_precision_inputs_attend_in_fp32_on_cpu():
    """bf16/fp16 query/key/value (as under autocast) give outputs of their own dtype, equal to the
    fp32 per-document result rounded once (the CPU kernels attend in fp32)."""
    from trainforge.model.packed_attention import packed_sdpa_forward

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=gen) for _ in range(3))
    pos = torch.tensor([list(range(10)) + list(range(14)), list(range(24))])
    module = torch.nn.Module().eval()
    ref, _ = packed_sdpa_forward(module, q, k, v, None, position_ids=pos)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = packed_sdpa_forward(module, q.to(dtype), k.to(dtype), v.to(dtype), None, position_ids=pos)
        assert out.dtype == dtype
        rounded, _ = packed_sdpa_forward(module, q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), None, position_ids=pos)
        torch.testing.assert_close(out, rounded.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_values_narrower_than_queries_as_in_multi_head_latent_attention():
    """DeepSeek-style attention: queries and keys of 16 dims, values of 8; the output has the values' width and
    equals the stock masked SDPA per document (a traceback before: every tensor was reshaped to the queries' width)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trainforge.model.packed_attention import packed_sdpa_forward

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 12, 16, generator=gen), torch.randn(1, 4, 12, 16, generator=gen)
    v = torch.randn(1, 4, 12, 8, generator=gen)
    module = torch.nn.Module()
    module.is_causal = True
    pos = torch.tensor([list(range(5)) + list(range(7))])
    out, _ = packed_sdpa_forward(module, q, k, v, None, position_ids=pos)
    assert out.shape == (1, 12, 4, 8)
    mask = torch.zeros(12, 12, dtype=torch.bool)
    mask[:5, :5] = torch.ones(5, 5).tril().bool()
    mask[5:, 5:] = torch.ones(7, 7).tril().bool()
    ref, _ = sdpa_attention_forward(module, q, k, v, mask[None, None], scaling=None)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
