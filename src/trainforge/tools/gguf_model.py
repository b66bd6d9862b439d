"""A Hugging Face decoder's hyperparameters and tensors as llama.cpp's GGUF names them.

The families are those llama.cpp runs and transformers' GGUF loader reads back (the export's
independent check): Llama, Mistral (llama.cpp's ``llama`` architecture), Qwen2, Qwen3 and Phi-3.
Tensor names come from gguf-py's tensor-name maps (``gguf.get_tensor_name_map``), metadata keys
from its ``GGUFWriter`` methods (``gguf.Keys``): nothing here spells a GGUF name by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import TrainforgeError


class GGUFExportError(TrainforgeError, ValueError):
    """A model, tokenizer or option the GGUF export cannot handle (the message says what to do)."""


# HF model_type -> gguf.MODEL_ARCH member name. Mistral (v0.1-v0.3 shape) is llama.cpp's llama architecture.
FAMILIES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "phi3": "PHI3"}
# llama.cpp's converter permutes Q/K rows of its llama architecture (HF's rotate-half RoPE layout into
# llama.cpp's interleaved one); transformers' GGUF reader undoes it for that architecture only
PERMUTED_QK = ("LLAMA",)
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass
class Family:
    """What to write a model of one HF ``model_type`` as."""

    model_type: str
    arch: Any  # gguf.MODEL_ARCH

    @property
    def arch_name(self) -> str:
        import gguf

        return gguf.MODEL_ARCH_NAMES[self.arch]


def family_of(config: dict[str, Any], where: str) -> Family:
    """The family of a config.json (``where`` names the file); refused with the supported list otherwise."""
    import gguf

    model_type = str(config.get("model_type", ""))
    if model_type not in FAMILIES:
        raise GGUFExportError(
            f"{where}: model_type {model_type!r} cannot be exported to GGUF; supported families: "
            f"{', '.join(sorted(FAMILIES))}. Export a Hugging Face directory instead (--format hf) and convert "
            "it with llama.cpp's convert_hf_to_gguf.py"
        )
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise GGUFExportError(
            f"{where}: RoPE scaling {rope.get('rope_type')!r} is not exported to GGUF (supported: {', '.join(ROPE_TYPES)}); "
            "export a Hugging Face directory (--format hf)"
        )
    return Family(model_type, getattr(gguf.MODEL_ARCH, FAMILIES[model_type]))


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings of a config dict or object: transformers 5's ``rope_parameters``, else the older keys."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    rope.setdefault("rope_theta", get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def write_hparams(writer, config, family: Family, vocab_size: int) -> None:
    """Context length, widths, head counts (KV heads too), norm epsilon, RoPE base, width and scaling."""
    import gguf

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = head_dim(config)
    rope = rope_parameters(config)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(kv_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    rotary = int(dim * float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)))
    writer.add_rope_dimension_count(rotary)
    if dim != config.hidden_size // heads:  # an explicit head width (Qwen3) that the hidden size does not imply
        writer.add_key_length(dim)
        writer.add_value_length(dim)
    writer.add_vocab_size(int(vocab_size))
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        original = rope.get("original_max_position_embeddings")
        if original:
            writer.add_rope_scaling_orig_ctx_len(int(original))
    # llama3: llama.cpp takes per-frequency factors as a tensor (rope_freqs, below), not keys


def llama3_rope_factors(config) -> np.ndarray:
    """Llama 3.1's per-frequency RoPE divisors (llama.cpp's ``rope_freqs`` tensor): 1 for short wavelengths,
    ``factor`` for long ones, a smooth blend between, over the ``head_dim / 2`` rotary frequencies."""
    rope = rope_parameters(config)
    dim = head_dim(config)
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factors = []
    for freq in inv_freq:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def permute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from HF's halves (x0..x(d/2-1), x(d/2)..) to llama.cpp's pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(model: torch.nn.Module, family: Family) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array) for every weight llama.cpp reads; the output matrix is left out when tied."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp uses token_embd for the output when output.weight is absent
        if "rotary_emb" in hf_name:
            continue  # buffers recomputed from the RoPE metadata
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFExportError(
                f"tensor {hf_name} of this {family.model_type} model has no GGUF name in gguf-py's "
                f"{family.arch_name} map; export a Hugging Face directory instead (--format hf)"
            )
        data = tensor.detach().float()
        if family.arch.name in PERMUTED_QK and ".attn_q." in name:
            data = permute_qk(data, heads)
        elif family.arch.name in PERMUTED_QK and ".attn_k." in name:
            data = permute_qk(data, kv_heads)
        yield name, data.numpy()
    if rope_parameters(config)["rope_type"] == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(config)


QUANTS = ("f16", "bf16", "q8_0")


def file_type(quant: str):
    """general.file_type for ``quant``."""
    import gguf

    return {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant]


def encode(data: np.ndarray, quant: str) -> tuple[np.ndarray, Any]:
    """The bytes (or array) to store for one tensor and its ggml type. Vectors (norms, biases, RoPE factors)
    stay f32 as llama.cpp keeps them; a matrix whose rows are not whole Q8_0 blocks is stored f16."""
    import gguf

    types = gguf.GGMLQuantizationType
    if data.ndim <= 1:
        return data.astype(np.float32), types.F32
    if quant == "f16":
        return data.astype(np.float16), types.F16
    if quant == "bf16":
        return gguf.quants.quantize(data, types.BF16), types.BF16
    block = gguf.GGML_QUANT_SIZES[types.Q8_0][0]
    if data.shape[-1] % block:
        return data.astype(np.float16), types.F16
    return gguf.quants.quantize(data, types.Q8_0), types.Q8_0
