"""A model that adds terms of its own onto the attention mask (Doge's learned dynamic mask) trains on transformers'
stock SDPA: the document kernels' mask function builds no mask, so such a model handed them a mask without its
causal part, and every token attended to the tokens after it."""

from __future__ import annotations

import pytest
import torch

from trainforge.model import doc_attention

DOGE = {"architecture": "doge", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}


def test_doge_is_a_model_that_adds_to_its_mask_and_llama_is_not():
    """transformers' code of such a model asks for its mask always materialized, as an argument (Doge) or a dict
    entry (Qwen4-Exp, whose token indexer reads the mask)."""
    from transformers import DogeConfig, LlamaConfig, Qwen4ExpTextConfig

    assert doc_attention.uncovered_attention(Qwen4ExpTextConfig())[0] == "sdpa"
    stock, why = doc_attention.uncovered_attention(DogeConfig())
    assert stock == "sdpa" and "DogeForCausalLM works on its causal mask" in why
    assert doc_attention.uncovered_attention(LlamaConfig()) is None


def test_doge_trains_causally_with_its_documents_apart(tiny_tokenizer_dir):
    """Under auto the model gets stock SDPA (said once); a token's logits depend on no later token and on no other
    document of its packed row. Before, on the CPU kernel, the logits of the first tokens changed with the last."""
    from trainforge.config.run import ModelSettings
    from trainforge.model.load import AttentionUnavailable, build_model
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    warned: list[str] = []
    model = build_model(ModelSettings(init=DOGE, tokenizer=tiny_tokenizer_dir), tok, 0, torch.device("cpu"), False,
                        warn=warned.append)
    assert model.config._attn_implementation == "sdpa" and any("dynamic mask" in w for w in warned)
    with torch.no_grad():  # a nonzero A: the dynamic mask then differs per key, as in a trained model
        for layer in model.model.layers:
            layer.self_attn.A.normal_()
    model.eval()
    ids = torch.randint(5, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(10), torch.arange(6)]).unsqueeze(0)  # two packed documents

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits  # as training calls it

    base = logits(ids)
    later = ids.clone()
    later[0, 7:10] = 3  # the first document's last tokens
    assert torch.allclose(logits(later)[0, :7], base[0, :7], atol=1e-6)
    assert not torch.allclose(logits(later)[0, 7:10], base[0, 7:10], atol=1e-6)
    other = ids.clone()
    other[0, :10] = 4  # the whole first document
    assert torch.allclose(logits(other)[0, 10:], base[0, 10:], atol=1e-6)
    with pytest.raises(AttentionUnavailable, match="packed_sdpa would change.*works on its causal mask"):
        build_model(ModelSettings(init=DOGE, tokenizer=tiny_tokenizer_dir, attention="packed_sdpa"), tok, 0,
                    torch.device("cpu"), False)
