"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, AXK2): each layer's indexer picks every query's keys from
the causal mask it reads itself, so trainforge's document kernels (which hand the layer no mask) cannot run it;
``auto`` takes transformers' SDPA with its document mask, and a packed row computes what its documents alone do."""

from __future__ import annotations

import torch

from trainforge.model import doc_attention


def tiny_v32(**fields):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, index_head_dim=16, index_n_heads=2, max_position_embeddings=64, **fields)


def test_indexed_attention_is_left_to_sdpa_and_dense_attention_is_not():
    from transformers import LlamaConfig

    stock, why = doc_attention.uncovered_attention(tiny_v32())
    assert stock == "sdpa" and "indexer" in why
    assert doc_attention.uncovered_attention(LlamaConfig()) is None


def test_a_packed_row_computes_each_document_alone():
    """Under auto on CPU the model runs transformers' SDPA (a traceback before: the indexer read a None mask); two
    documents packed in one row (position_ids restart) give the logits each gives alone. The indexer keeps every
    visible key here: with fewer kept, its ReLU'd scores tie at 0 and top-k may break a tie another way when the
    keys sit at other offsets of the row (not a packing matter)."""
    index_topk = 64
    from transformers import AutoModelForCausalLM

    from trainforge.model.load import attention_implementation, exact_attention

    config = tiny_v32(index_topk=index_topk)
    warned = []
    attn = exact_attention(config, "auto", attention_implementation("auto", torch.device("cpu")), warned.append)
    assert attn == "sdpa" and "indexer" in warned[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    a, b = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 9))
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=position_ids, use_cache=False).logits
        alone = torch.cat([model(input_ids=x, use_cache=False).logits for x in (a, b)], dim=1)
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_indexed_attention_without_an_sdpa_path_takes_eager():
    """HY-V4's indexer reads the mask like DeepSeek's, and transformers gives it no SDPA: eager, not a ValueError."""
    from trainforge.model.doc_attention import uncovered_attention
    from trainforge.tools.family_shrink import tiny_config

    assert uncovered_attention(tiny_config("hy_v4", 64))[0] == "eager"
