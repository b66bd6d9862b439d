"""Tiny random configs of every transformers causal-LM family, built locally (no download).

``tiny_config(family, vocab_size)`` takes the family's config class with its defaults and shrinks the
known size fields (hidden size, layers, heads, experts, ...) recursively through sub-configs; a few
families need their own keys (``OVERRIDES``). Used by the family matrix (``family_matrix.py``).
"""

from __future__ import annotations

from typing import Any

HIDDEN = 32
LAYERS = 2

# field -> tiny value; a field is set only where the default config has it (not None unless listed in _EVEN_NONE)
_SIZES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "hidden_dim", "model_dim",
                     "emb_dim"), HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
                     "encoder_ffn_dim", "mlp_dim", "inner_hidden_size", "dense_intermediate_size"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "shared_intermediate_size", "intermediate_size_mlp",
                     "moe_shared_expert_intermediate_size", "expert_dim"), 32),
    **dict.fromkeys(("ext_pw_out_channel", "depthwise_separable_out_channel", "nemo_conv_channels"), 32),  # Phi-4-mm audio
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "decoder_layers",
                     "encoder_layers", "num_encoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
                     "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_key_value_groups"), 2),
    "head_dim": 8, "attention_head_size": 8, "rotary_dim": 8, "d_head": 8, "kv_channels": 8, "global_head_dim": 8,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length",
                     "max_seq_len"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "n_groups": 1,
    "linear_head_dim": 8, "linear_num_heads": 4,  # Kimi Linear's delta-rule heads (32 x 128 by default)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "sliding_window": 16, "attention_window_size": 16, "window_size": 16, "chunk_size": 16,
    "num_codebooks": 2, "audio_vocab_size": 64, "hidden_size_per_layer_input": 8,
    "encoder_hash_byte_group_vocab": 64,  # BLT's hash embeddings (500k rows by default)
    "hidden_size_global": HIDDEN,  # BLT's local encoder/decoder: the global model's width (2048 by default)
}
_EVEN_NONE = {"head_dim"}
_PER_LAYER = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types", "hybrid_override_pattern",
              "layers_block_types", "attn_layer_indices", "no_rope_layers", "moe_layers")
_VOCAB = ("vocab_size", "text_vocab_size", "vocab_size_per_layer_input")  # Gemma 3n/4's per-layer embeddings too
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
              "mask_token_id", "unk_token_id")

OVERRIDES: dict[str, dict[str, Any]] = {
    "hrm_text": {"H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1]},
    "mamba2": {"num_heads": 4, "head_dim": 16, "expand": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "zaya": {"num_experts_per_tok": 1},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "falcon_mamba": {"time_step_rank": 4},
    "mamba": {"time_step_rank": 4},
}
"""Per-family keys the generic shrinker cannot guess (set after it, at the top level)."""


def _shrink(d: dict[str, Any], vocab_size: int, special: dict[str, int]) -> dict[str, Any]:
    """``d`` (a config's to_dict()) with its size fields tiny, recursively through sub-config dicts."""
    out = dict(d)
    layers = next((_SIZES[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if isinstance(d.get(k), int)), None)
    mla = d.get("kv_lora_rank") is not None  # multi-head latent attention: as many key/value heads as query heads
    for key, value in d.items():
        if isinstance(value, dict) and ("model_type" in value or any(k in value for k in ("hidden_size", "d_model"))):
            out[key] = _shrink(value, vocab_size, special)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = _SIZES[key]
        elif key in _SIZES and isinstance(value, list) and layers and all(isinstance(v, int) for v in value):
            out[key] = [_SIZES[key]] * layers  # a per-layer size (Gemma 3n's intermediate sizes)
        elif key in _SIZES and value is None and key in _EVEN_NONE:
            out[key] = _SIZES[key]
        elif key in _VOCAB and isinstance(value, int):
            out[key] = vocab_size
        elif key in _TOKEN_IDS and isinstance(value, int) and value >= vocab_size:
            out[key] = special.get(key, 0)
        elif isinstance(value, dict) and layers and value and all(str(k).isdigit() for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < layers}  # per-layer settings keyed by index
        elif isinstance(value, list) and layers and key.endswith("_per_layer") and len(value) > layers:
            out[key] = value[:layers]
    if mla:
        for key in ("num_key_value_heads", "num_kv_heads"):
            if isinstance(out.get(key), int):
                out[key] = out.get("num_attention_heads", 4)
    default_layers = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if isinstance(d.get(k), int)), None)
    for key, value in d.items():
        if key not in _PER_LAYER and out[key] is value and isinstance(value, list) and layers and len(value) == default_layers != layers:
            out[key] = value[:layers]  # a list with one entry per layer (Gemma 3n's activation sparsity)
    for key in _PER_LAYER:
        value = d.get(key)
        if isinstance(value, list) and layers and len(value) > layers:
            out[key] = _keep_kinds(value, layers)
        elif isinstance(value, str) and layers and len(value) > layers:
            out[key] = value[:layers]
    return out


def _keep_kinds(kinds: list[Any], n: int) -> list[Any]:
    """The first ``n`` entries of a per-layer list, with each distinct kind kept where there is room (a hybrid's
    first layers are often all of one kind)."""
    seen: list[Any] = []
    for k in kinds:
        if k not in seen:
            seen.append(k)
    head = seen[:n]
    return head + [kinds[0]] * (n - len(head))


def tiny_config(family: str, vocab_size: int, special: dict[str, int] | None = None):
    """The family's config class with tiny sizes, ``vocab_size`` tokens and the tokenizer's special ids."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    base = cls().to_dict()
    shrunk = _shrink(base, vocab_size, special or {})
    shrunk.update(OVERRIDES.get(family, {}))
    shrunk.pop("model_type", None)
    shrunk.pop("transformers_version", None)
    return cls(**shrunk)
