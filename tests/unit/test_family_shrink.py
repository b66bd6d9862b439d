"""The family matrix's tiny configs (``tools/family_shrink.py``) are valid models: routing keys a MoE config class
leaves None are filled, and sizes its ``__post_init__`` derives follow the tiny sizes."""

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
