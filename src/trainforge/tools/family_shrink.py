"""Tiny random configs of every transformers causal-LM family, built locally (no download).

``tiny_config(family, vocab_size)`` takes the family's config class with its defaults and shrinks the
known size fields (hidden size, layers, heads, experts, ...) recursively through sub-configs; a few
families need their own keys (``OVERRIDES``). Used by the family matrix (``family_matrix.py``).

A default config's ``to_dict()`` also holds the sizes its ``__post_init__`` derived from the full ones (Zamba2's
``mamba_headdim``, xLSTM's ``embedding_dim``, DeepSeek's ``qk_head_dim``): such a size the shrinker does not set
itself is left out (a derived attribute) or given back as its declared default None, so the tiny config derives it
again from the tiny sizes.
A size field stored under another name (``attribute_map``: Bailing's ``n_group`` is ``num_expert_group``) is
shrunk under that name.
"""

from __future__ import annotations

import dataclasses
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
_EVEN_NONE = {"head_dim", "num_key_value_heads"}  # Nemotron leaves its key/value heads None (a checkpoint names them)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
# routing keys some MoE config classes default to None (DeepSeek-V2's experts per token, dots1's every count), set in
# every published checkpoint's config.json: filled wherever the config is a MoE one (see _is_moe)
_ROUTING = (*_EXPERT_COUNTS, "num_experts_per_tok", "moe_topk", "num_experts_per_token", "n_shared_experts",
            "num_shared_experts", "n_group", "topk_group")
_PER_LAYER = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types", "hybrid_override_pattern",
              "layers_block_types", "attn_layer_indices", "no_rope_layers", "moe_layers")
_VOCAB = ("vocab_size", "text_vocab_size", "vocab_size_per_layer_input",  # Gemma 3n/4's per-layer embeddings too
          "unpadded_vocab_size")  # Inkling 2: the rows its head keeps (the rest padding)
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
              "mask_token_id", "unk_token_id")

_QWEN4_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 16,
                  "indexer_compress_ratio": 4}  # Qwen4-Exp's indexed attention: no defaults (None // None)

OVERRIDES: dict[str, dict[str, Any]] = {
    "hrm_text": {"H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1]},
    "mamba2": {"num_heads": 4, "head_dim": 16, "expand": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "zaya": {"num_experts_per_tok": 1},
    # one layer before, in and after its recurrent section (an empty section reads as "the remaining layers"); the
    # layer kinds derived again for three layers
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "layer_types": None},
    # Gemma 4's drafters: their class's own defaults fail its validation (a text config with per-layer inputs)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "num_kv_shared_layers": 0}},  # 0: every layer shared (its __post_init__)
    "gemma4_unified_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                                 "num_kv_shared_layers": 0}},
    # DBRX's default attention config has no rope_theta and clip_qkv None (its layer clamps with it): a checkpoint's values
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # its sliding-window layers' head_dim is the latent attention's qk_nope_head_dim + qk_rope_head_dim (8 + 8)
    "dots3_note_text": {"head_dim": 16, "index_head_dim": 16, "index_n_heads": 4},
    "dots3_note": {"text_config": {"head_dim": 16, "index_head_dim": 16, "index_n_heads": 4},  # and its towers' adapters
                   "vision_config": {"adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN},
                   "audio_config": {"adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN}},
    "falcon_h1": {"mamba_d_ssm": 64},  # its SSM width (1024 by default): mamba_n_heads x mamba_d_head
    # Gemma 3n: its last layers reuse the key/value cache of the last earlier layer of their kind (15 of 35 by
    # default): two producing layers and two sharing, one of each kind, the per-layer lists as long
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "intermediate_size": [64] * 4,
                     "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    # rotary settings per layer kind (its default config has none: every checkpoint names them)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # Reformer's LM head runs as a decoder only; its axial position table factors a 64 x 192 width
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "falcon_mamba": {"time_step_rank": 4},
    "mamba": {"time_step_rank": 4},
    # its config class has no default per-layer kinds (every checkpoint lists them); one dense layer, one MoE
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},  # one shared block, tied
    # image-text checkpoints as published (the full config): a cross-attention layer in the tiny text stack, a vision
    # tower whose output width matches its layers, a small VQ-VAE (GroupNorm of 32 groups: 32 channels) whose 16 codes
    # map to tokens of the vocabulary
    "mllama": {"text_config": {"cross_attention_layers": [1]},
               "vision_config": {"num_global_layers": 1, "intermediate_layers_indices": [0], "vision_output_dim": 64}},
    "emu3": {"vq_config": {"base_channels": 32, "channel_multiplier": [1, 1], "num_res_blocks": 1, "codebook_size": 16},
             "vocabulary_map": {"<image>": 8, "<|extra_200|>": 9, **{f"<|visual token {i:06d}|>": 10 + i for i in range(16)}}},
}
"""Per-family keys the generic shrinker cannot guess (set after it; a dict is merged into that sub-config)."""


def _shrink(d: dict[str, Any], vocab_size: int, special: dict[str, int], cls: type | None = None) -> dict[str, Any]:
    """``d`` (a config's to_dict()) with its size fields tiny, recursively through sub-config dicts; ``cls`` is the
    config class of ``d`` where known (its fields, aliases and sub-config classes)."""
    out = dict(d)
    alias = {real: name for name, real in getattr(cls, "attribute_map", {}).items()}  # to_dict() uses the real name
    fields = _fields(cls)
    layers = next((_SIZES[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if isinstance(d.get(k), int)), None)
    mla = d.get("kv_lora_rank") is not None  # multi-head latent attention: as many key/value heads as query heads
    moe = _is_moe(d)
    touched: set[str] = set()  # keys given a tiny value here
    for key, value in d.items():
        size = key if key in _SIZES else alias.get(key) if alias.get(key) in fields else None  # fields take the alias
        if isinstance(value, dict) and ("model_type" in value or any(k in value for k in ("hidden_size", "d_model"))):
            out[key] = _shrink(value, vocab_size, special, _sub_config_class(cls, key, value))
        elif size in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = _SIZES[size]
        elif size in _SIZES and isinstance(value, list) and layers and all(isinstance(v, int) for v in value):
            out[key] = [_SIZES[size]] * layers  # a per-layer size (Gemma 3n's intermediate sizes)
        elif size in _SIZES and value is None and (size in _EVEN_NONE or (moe and size in _ROUTING)):
            out[key] = _SIZES[size]
        elif key in _VOCAB and isinstance(value, int):
            out[key] = vocab_size
        elif key in _TOKEN_IDS and isinstance(value, int) and value >= vocab_size:
            out[key] = special.get(key, 0)
        elif isinstance(value, dict) and layers and value and all(str(k).isdigit() for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < layers}  # per-layer settings keyed by index
        elif isinstance(value, list) and layers and key.endswith("_per_layer") and len(value) > layers:
            out[key] = value[:layers]
        else:
            continue
        touched.add(key)
    if mla:
        for key in ("num_key_value_heads", "num_kv_heads"):
            if isinstance(out.get(key), int):
                out[key] = out.get("num_attention_heads", 4)
    default_layers = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if isinstance(d.get(k), int)), None)
    for key, value in d.items():
        if key not in _PER_LAYER and out[key] is value and isinstance(value, list) and layers and len(value) == default_layers != layers:
            out[key] = value[:layers]  # a list with one entry per layer (Gemma 3n's activation sparsity)
            touched.add(key)
    for key in _PER_LAYER:
        value = d.get(key)
        if isinstance(value, list) and layers and len(value) > layers:
            out[key] = _keep_kinds(value, layers)
        elif isinstance(value, str) and layers and len(value) > layers:
            out[key] = value[:layers]
    if fields:  # sizes __post_init__ derived from the full sizes, left as they were: derived again from the tiny ones
        for key, value in d.items():
            if key not in touched and _is_size(value) and key not in _PER_LAYER and key not in _common_fields():
                declared = key if key in fields else alias.get(key)
                if declared not in fields:
                    del out[key]
                elif fields[declared] is None:
                    out[key] = None
    return out


def _is_moe(d: dict[str, Any]) -> bool:
    """A mixture-of-experts config: an expert count or an expert's width is set."""
    return any(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in (*_EXPERT_COUNTS, "moe_intermediate_size"))


_NO_DEFAULT = object()


def _fields(cls: type | None) -> dict[str, Any]:
    """A config class's dataclass fields with their declared defaults (``_NO_DEFAULT`` where a factory or nothing
    gives it); {} where the class is not known or not a dataclass."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f.default if f.default is not dataclasses.MISSING else _NO_DEFAULT for f in dataclasses.fields(cls)}


def _is_size(value: Any) -> bool:
    """A number of units or a list of layer indices (what a config derives from its sizes), not a flag or a ratio."""
    if isinstance(value, list):
        return bool(value) and all(_is_size(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def _common_fields() -> dict[str, Any]:
    """The fields every config has (labels, token ids, dtype, ...): none of them derives from a size."""
    from transformers import PreTrainedConfig

    return _fields(PreTrainedConfig)


def _sub_config_class(cls: type | None, key: str, value: dict[str, Any]) -> type | None:
    """The config class of the sub-config ``key`` of ``cls``: its declared class, else its model type's."""
    from transformers import CONFIG_MAPPING

    sub = getattr(cls, "sub_configs", {}).get(key)
    if isinstance(sub, type) and dataclasses.is_dataclass(sub):
        return sub
    return CONFIG_MAPPING[value["model_type"]] if value.get("model_type") in CONFIG_MAPPING else None


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
    try:
        defaults = cls().to_dict()
    except Exception:  # a class whose own defaults fail its validation: from its overrides (Gemma 4's drafter)
        defaults = cls(**OVERRIDES.get(family, {})).to_dict()
    return _shrunk(cls, defaults, family, vocab_size, special or {})


def shrink_config(config: Any, vocab_size: int = 64):
    """A tiny copy of ``config`` (a transformers config): its own fields (soft-capping, sliding windows, layer kinds,
    attention sinks) with the sizes shrunk as ``tiny_config`` shrinks a family's defaults, and ``vocab_size`` tokens."""
    return _shrunk(type(config), config.to_dict(), str(getattr(config, "model_type", "")), vocab_size, {})


def _shrunk(cls: type, d: dict[str, Any], family: str, vocab_size: int, special: dict[str, int]):
    """``cls`` built from ``d`` with its sizes shrunk and the family's ``OVERRIDES`` merged in."""
    shrunk = _shrink(d, vocab_size, special, cls)
    for key, value in OVERRIDES.get(family, {}).items():
        shrunk[key] = {**shrunk[key], **value} if isinstance(value, dict) and isinstance(shrunk.get(key), dict) else value
    for key in ("model_type", "transformers_version", "architectures", "auto_map", "quantization_config"):
        shrunk.pop(key, None)
    return cls(**shrunk)
