"""The family matrix's tiny configs (``trainforge/tools/family_shrink.py``) are valid models of the published shape."""

from __future__ import annotations

from trainforge.tools.family_shrink import tiny_config


def test_moe_routing_left_none_by_the_config_class_is_filled():
    deepseek_v2 = tiny_config("deepseek_v2", 300)  # num_experts_per_tok defaults to None (topk(k=None) before)
    assert deepseek_v2.num_experts_per_tok == 2 and deepseek_v2.n_routed_experts == 4
    dots1 = tiny_config("dots1", 300)  # every expert count defaults to None (torch.empty(None, ...) before)
    assert (dots1.n_routed_experts, dots1.num_experts_per_tok, dots1.n_shared_experts) == (4, 2, 1)


def test_a_dense_config_gets_no_experts():
    gemma4 = tiny_config("gemma4_text", 300)  # num_experts None: a dense model unless enable_moe_block
    assert gemma4.num_experts is None


def test_a_size_derived_in_post_init_follows_the_tiny_sizes():
    longcat = tiny_config("longcat_flash", 300)  # qk_head_dim = nope + rope (192 from the defaults before)
    assert longcat.qk_head_dim == longcat.qk_nope_head_dim + longcat.qk_rope_head_dim == 16


def test_values_the_config_derived_from_the_full_sizes_follow_the_tiny_ones():
    """A default config's to_dict() holds what __post_init__ derived from the full sizes; passed back they overrode
    the tiny sizes (xLSTM's 4096-wide embedding beside a 32-wide model, Zamba2's 640-wide Mamba heads)."""
    xlstm = tiny_config("xlstm", 300)
    assert xlstm.embedding_dim == xlstm.hidden_size == 32 and xlstm.num_blocks == xlstm.num_hidden_layers == 2
    zamba2 = tiny_config("zamba2", 300)
    assert zamba2.mamba_headdim * zamba2.n_mamba_heads == zamba2.mamba_expand * zamba2.hidden_size
    assert zamba2.attention_head_dim * zamba2.num_attention_heads == zamba2.attention_hidden_size == 2 * zamba2.hidden_size


def test_a_size_stored_under_another_name_is_shrunk():
    """Bailing's n_group is stored as num_expert_group (attribute_map): left at 8 it split 4 experts into 8 groups."""
    bailing = tiny_config("bailing_hybrid", 300)
    assert bailing.to_dict()["num_expert_group"] == bailing.n_group == 1
    assert bailing.num_experts % bailing.n_group == 0


def test_image_text_families_keep_their_full_config():
    """Mllama and Emu3 as published: the whole image-text config, tiny, with a cross-attention layer in Mllama's
    text stack and a vision output as wide as its layers give."""
    mllama = tiny_config("mllama", 300)
    assert mllama.model_type == "mllama" and mllama.text_config.cross_attention_layers == [1]
    assert mllama.text_config.num_hidden_layers == 2 and mllama.text_config.vocab_size == 300
    vision = mllama.vision_config
    assert vision.vision_output_dim == vision.hidden_size * (len(vision.intermediate_layers_indices) + 1)
    emu3 = tiny_config("emu3", 300)
    assert emu3.model_type == "emu3" and emu3.text_config.hidden_size == 32 and emu3.vq_config.base_channels == 32


def test_families_with_keys_of_their_own_build():
    """Nemotron leaves its key/value heads None, Qwen4-Exp its token indexer's sizes; Zamba ties one shared block
    across its hybrid layers, so it needs two of them."""
    from transformers import AutoModelForCausalLM

    for family in ("nemotron", "qwen4_exp_text", "zamba"):
        assert AutoModelForCausalLM.from_config(tiny_config(family, 300)).num_parameters() > 0


def test_a_gemma4_drafter_is_built_tiny_and_refused_with_its_target_named(tmp_path):
    """Gemma 4's assistants (drafters for assisted generation) read their target model's key/value states in every
    layer: a tiny one builds (its class's own defaults fail its validation) and model.path at it is exit 2 naming
    the model to fine-tune instead, before any work (model_kind reads its directory without a traceback)."""
    import pytest
    from transformers import AutoModelForCausalLM

    from trainforge.hf_dir import UnsupportedModelDir, model_kind
    from trainforge.model.load import check_model_dir
    from trainforge.tools.family_shrink import tiny_config

    AutoModelForCausalLM.from_config(tiny_config("gemma4_assistant", 64)).save_pretrained(tmp_path)
    assert model_kind(tmp_path).encoder_decoder is False
    with pytest.raises(UnsupportedModelDir, match="drafter for assisted generation.*fine-tune the gemma4 model") as e:
        check_model_dir(tmp_path)
    assert e.value.exit_code == 2
