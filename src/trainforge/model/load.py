"""Build the model a run trains: pretrained from a local directory or from scratch; full, LoRA or QLoRA."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config.run import ConfigError, LoraSettings, ModelSettings
from ..errors import TrainforgeError
from ..hf_dir import attention_of, has_sdpa, init_kind, read_config, refuse_adapter, refuse_custom_code
from .experts_impl import use_experts_implementation
from .fp8 import apply_fp8
from .inputs import settle_inputs
from .kernels import apply_liger, restore_torch_layers
from .nf4_experts import quantize_experts
from .lora_apply import apply_lora  # noqa: F401 (where callers have always found it)
from .multimodal import describe_text_only, freeze_non_text, image_text_class, refuse_a_drafter, refuse_a_part


def init_config(init: dict[str, Any], tokenizer):
    """A transformers config from ``model.init``, sized to the tokenizer and its special tokens."""
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in init.items() if k != "architecture"}
    fields.setdefault("vocab_size", len(tokenizer))
    if fields["vocab_size"] < len(tokenizer):
        raise ConfigError(
            f"model.init.vocab_size={fields['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens; "
            "raise it, or leave it out to size the model to the tokenizer"
        )
    fields.setdefault("eos_token_id", tokenizer.eos_token_id)
    fields.setdefault("pad_token_id", tokenizer.pad_token_id)
    fields.setdefault("bos_token_id", tokenizer.bos_token_id)
    config_class = CONFIG_MAPPING[init["architecture"]]
    if init_kind(init).encoder_decoder:
        # the decoder starts from the pad token (T5's convention); BART's defaults name ids of its own vocabulary
        fields.setdefault("decoder_start_token_id", tokenizer.pad_token_id)
        if getattr(config_class(), "forced_eos_token_id", None) is not None:
            fields.setdefault("forced_eos_token_id", tokenizer.eos_token_id)
    return config_class(**fields)


def model_class(cfg: ModelSettings):
    """``AutoModelForSeq2SeqLM`` for an encoder-decoder (T5, BART, ...), else ``AutoModelForCausalLM``."""
    return auto_model_class(cfg.kind.encoder_decoder, cfg.kind.model_type)


def auto_model_class(encoder_decoder: bool, model_type: str | None = None):
    """The transformers auto class of a model of this kind (``hf_dir.model_kind`` of a directory). Chosen, never
    guessed: ``AutoModelForCausalLM`` would load BART's directory as its decoder alone, and Mllama's or Emu3's
    image-text checkpoint as its language model alone (``multimodal.image_text_class``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if encoder_decoder else image_text_class(model_type) or AutoModelForCausalLM


# model types of the T5 family: trained in bf16, their feed-forward activations exceed fp16's range (65504)
T5_FAMILY = ("t5", "mt5", "umt5", "longt5", "switch_transformers")


def overflows_in_fp16(cfg: ModelSettings) -> str | None:
    """The model type when the configured model is of the T5 family (known to overflow in fp16), else None."""
    kind = cfg.kind.model_type
    return kind if kind in T5_FAMILY else None


def decoder_start_token_id(cfg: ModelSettings, tokenizer) -> int:
    """The token an encoder-decoder's decoder starts from (T5: pad, BART: EOS), from its config or
    generation config; the labels shifted right behind it are the decoder's inputs."""
    if cfg.init is not None:
        start = init_config(cfg.init, tokenizer).decoder_start_token_id
    else:
        from transformers import AutoConfig, GenerationConfig

        path = str(cfg.path.resolve())
        refuse_custom_code(cfg.path, "model.path")
        start = getattr(AutoConfig.from_pretrained(path, trust_remote_code=False), "decoder_start_token_id", None)
        if start is None and (cfg.path / "generation_config.json").is_file():
            start = GenerationConfig.from_pretrained(path).decoder_start_token_id
    if start is None:
        raise ConfigError(
            f"model: the encoder-decoder config has no decoder_start_token_id (config.json or generation_config.json "
            f"of {cfg.path or cfg.init.get('architecture')}); add it there (T5 uses the pad token, BART its EOS)"
        )
    return int(start)


def attention_implementation(
    requested: str, device: torch.device, half_precision: bool = True, encoder_decoder: bool = False,
    model_type: str | None = None,
) -> str:
    """The ``attn_implementation`` a model trains with. ``auto``: on CPU, packed documents batched by
    length (``packed_attention``); on CUDA, torch's built-in Flash varlen kernel on sm80+ in bf16/fp16,
    else FlexAttention with a document mask (``doc_attention``). None of them builds a row x row mask.
    ``varlen``/``flex`` ask for those two by name; ``flash_attention_2`` needs the flash-attn package.
    ``encoder_decoder``: rows hold one padded example each; ``auto`` is stock SDPA everywhere, or eager for a
    ``model_type`` whose transformers class has no SDPA (Switch Transformers, LongT5, LED, ...)."""
    if encoder_decoder:  # the config refuses packed_sdpa, varlen and flex for these models
        return requested if requested != "auto" else "sdpa" if has_sdpa(model_type) else "eager"
    if requested == "packed_sdpa" or (requested == "auto" and device.type == "cpu"):
        from .packed_attention import register

        return register()
    from . import doc_attention

    if requested in ("varlen", "flex"):
        if requested == "varlen":
            capability = torch.cuda.get_device_capability(device) if device.type == "cuda" and torch.cuda.is_available() else None
            missing = (
                "CUDA" if device.type != "cuda" else
                "torch >= 2.10" if not doc_attention.has_varlen() else
                f"an sm80+ GPU (this one is sm{capability[0]}{capability[1]})" if capability is not None
                and capability < doc_attention.VARLEN_MIN_CAPABILITY else
                "bf16 or fp16 (the flash kernel has no fp32: train.precision is fp32)" if not half_precision else None
            )
            if missing:
                raise AttentionUnavailable(
                    f"model.attention: varlen is torch's Flash varlen kernel: it needs CUDA (sm80+, bf16/fp16) and "
                    f"torch >= 2.10, and here lacks {missing}; use auto (packed_sdpa on CPU, flex where varlen cannot run)"
                )
        return doc_attention.register(doc_attention.VARLEN_NAME if requested == "varlen" else doc_attention.FLEX_NAME)
    if requested != "auto" or device.type != "cuda":
        return requested if requested != "auto" else "sdpa"  # MPS: stock SDPA
    capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
    chosen = doc_attention.choose("auto", "cuda", capability, half_precision, doc_attention.has_varlen())
    return doc_attention.register(chosen)


def exact_attention(config: Any, requested: str, attn: str, warn: Callable[[str], None]) -> str:
    """``attn``, unless it is a document kernel and the model (its transformers ``config``) computes attention
    in a way the kernel does not (Gemma 2's soft-capped logits): then, under ``auto``, transformers' stock
    implementation, said once (whether its mask keeps packed documents apart was measured before the data was
    packed: ``engine/packing_check``); a kernel asked for by name is refused."""
    from .doc_attention import uncovered_attention

    uncovered = uncovered_attention(config) if attn.startswith("trainforge_") else None
    if uncovered is None:
        return attn
    stock, why = uncovered
    fixed = why == attention_of(config.to_dict())  # attention of its own: one example per row, no document mask
    if requested != "auto":
        raise AttentionUnavailable(
            f"model.attention: {requested} would change this model's attention: {why}, which it does not apply; "
            f"use auto or {stock} (transformers' own, {'one example per row' if fixed else 'with a document mask'})"
        )
    if stock == "eager":  # where eager's mask lets packed documents meet (GPT-OSS), its eager run per document
        from .packing_probe import packing_attention

        stock = packing_attention(config, stock, auto_model_class(False, getattr(config, "model_type", None)))[0]
    if not fixed:  # attention of its own: the model line names it; packing was settled by engine/packing_check
        warn(f"attention: {stock} for this model ({why}, which trainforge's document kernels do not apply): " + (
             "its eager attention per document, with transformers' row x row mask" if stock.startswith("trainforge_") else "transformers "
             "builds a row x row mask") + ", slower on long rows")
    return stock


class AttentionUnavailable(TrainforgeError, ValueError):
    """The configured attention kernel cannot run on this device or torch build."""


def check_model_dir(path: str | Path) -> None:
    """A ``model.path`` a run may start from: no code of its own to run (``trust_remote_code=False`` besides),
    and a model, not a PEFT adapter to merge first."""
    refuse_custom_code(path, "model.path")
    refuse_adapter(path)
    model_type = read_config(path).get("model_type")
    refuse_a_part(model_type)
    refuse_a_drafter(model_type)


def build_model(
    cfg: ModelSettings,
    tokenizer,
    seed: int,
    device: torch.device | None = None,
    half_precision: bool = True,
    compute_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    kernels: str = "torch",
    fp8: str | None = None,
    warn: Callable[[str], None] = lambda _: None,
) -> torch.nn.Module:
    """The trainable model: weights loaded or seeded-initialized, LoRA/QLoRA-wrapped when asked.

    ``half_precision``: the run computes in bf16/fp16 (decides whether flash-attention can serve);
    ``compute_dtype``: that dtype. Under LoRA and QLoRA the frozen base is stored in it (nothing
    of the base trains, so fp32 master copies would buy nothing), while adapters stay fp32. A
    full fine-tune keeps fp32 master weights; autocast does the low-precision compute.
    ``activation_checkpointing``: each decoder layer recomputes its activations in backward.
    ``kernels``: ``liger`` swaps in Liger's kernels before adapters wrap the layers (model/kernels.py);
    the ones in use are listed in ``model.trainforge_kernels``.
    ``fp8``: a torchao recipe; the linear layers run their matmuls in FP8 (model/fp8.py), converted
    before adapters wrap them, so a LoRA base runs in FP8 under bf16 adapters.
    """
    auto_class = model_class(cfg)  # AutoModelForSeq2SeqLM for T5, BART, ...
    if kernels != "liger":
        restore_torch_layers()  # an earlier model of this process may have had Liger patch transformers' modules
    attn = attention_implementation(cfg.attention, device or torch.device("cpu"), half_precision, cfg.kind.encoder_decoder,
                                    cfg.kind.model_type)
    torch.manual_seed(seed)  # same seed, same initial weights (from scratch) and adapters (LoRA)
    base_dtype = storage_dtype(cfg, compute_dtype)
    if cfg.init is not None:
        config = init_config(cfg.init, tokenizer)
        attn = exact_attention(config, cfg.attention, attn, warn)
        model = auto_class.from_config(config, dtype=torch.float32, attn_implementation=attn, trust_remote_code=False)
    else:
        check_model_dir(cfg.path)
        from transformers import AutoConfig

        attn = exact_attention(AutoConfig.from_pretrained(str(cfg.path.resolve()), trust_remote_code=False), cfg.attention, attn, warn)
        extra = {"quantization_config": nf4_config(compute_dtype)} if cfg.method == "qlora" else {}
        # loaded straight in the storage dtype: no fp32 copy of a bf16 base is ever materialized
        model = auto_class.from_pretrained(
            str(cfg.path.resolve()), dtype=base_dtype, attn_implementation=attn, trust_remote_code=False, **extra
        )
        rows = model.get_input_embeddings().num_embeddings
        if rows < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
            if cfg.method != "full":  # adapters train none of the new rows (nor are they saved with the adapter)
                added = tokenizer.convert_ids_to_tokens(list(range(rows, min(len(tokenizer), rows + 3))))
                n = len(tokenizer) - rows
                warn(f"the tokenizer has {n} token{'s' if n != 1 else ''} beyond the model's {rows} embedding rows "
                     f"({', '.join(added)}{', ...' if n > 3 else ''}): their new rows start random and "
                     f"{cfg.method} trains none of them, so the model cannot learn to read or write them; use model.method: full, "
                     "or a tokenizer without added tokens (reuse an existing token as the marker)")
    for note in (settle_inputs(model.config), describe_text_only(model, freeze_non_text(model))):  # X-MOD's language;
        if note:  # an image-text checkpoint: its language model trains
            warn(note)
    used = apply_liger(model, warn) if kernels == "liger" else []
    fp8_layers = apply_fp8(model, fp8) if fp8 else 0
    if fp8 and not fp8_layers:
        warn("train.fp8: no linear layer has sides that are multiples of 16 (FP8 tensor cores need them): the run is plain bf16")
    experts = use_experts_implementation(model, cfg.experts_implementation, device or torch.device("cpu"), compute_dtype)
    model = adapt(model, cfg, activation_checkpointing)
    model.trainforge_experts = experts  # (implementation, why) of a mixture-of-experts model's routed experts
    model.trainforge_kernels = used
    model.trainforge_fp8 = f"{fp8} ({fp8_layers} linear layers)" if fp8 else None
    return model


def storage_dtype(cfg: ModelSettings, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The base weights' dtype: the compute dtype under LoRA/QLoRA (nothing of the base trains), else fp32."""
    adapters = cfg.method in ("lora", "qlora")
    return compute_dtype if adapters and compute_dtype is not None else torch.float32


def adapt(model: torch.nn.Module, cfg: ModelSettings, activation_checkpointing: bool) -> torch.nn.Module:
    """Checkpointing, then LoRA/QLoRA adapters with everything trainable in fp32 (fp32 Adam state)."""
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.method in ("lora", "qlora"):
        if cfg.method == "qlora":
            keep_norms_fp32(model)
            one_weight_layout(model)
        model = apply_lora(model, cfg.lora)
        if cfg.method == "qlora":
            model.trainforge_nf4_experts = quantize_experts(model)  # the routed experts' 3-D weights too (nf4_experts.py)
        for param in model.parameters():  # adapters (and anything else that trains) in fp32, with fp32 Adam state
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    return model


def architecture_field(cfg: ModelSettings, name: str):
    """A field of the model's architecture (``num_hidden_layers``, ...) from ``model.init`` or the
    directory's config.json, without building anything; None when it is not given."""
    if cfg.init is not None:
        return cfg.init.get(name)
    return read_config(cfg.path).get(name)


ROTARY_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base", "partial_rotary_factor")


def positions_in(fields: dict[str, Any]) -> tuple[int | None, bool]:
    """(the positions a decoder's config declares, whether they are learned embeddings): a learned table
    (GPT-2's n_positions, OPT, GPT-Neo) is a hard limit, a row past it indexes outside the table; rotary
    positions (Llama, Qwen, Mistral, ...) run past it, beyond what the model was trained on."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        if isinstance(fields.get(name), int):
            return fields[name], not any(k in fields for k in ROTARY_FIELDS)
    return None, False


def position_limit(cfg: ModelSettings) -> tuple[int | None, bool]:
    """``positions_in`` of the model ``cfg`` names (None for an encoder-decoder, whose sources and targets
    are limited by data.max_length and max_target_length)."""
    if cfg.kind.encoder_decoder:
        return None, False
    if cfg.init is not None:
        from transformers import CONFIG_MAPPING

        fields = {k: v for k, v in cfg.init.items() if k != "architecture"}
        return positions_in(CONFIG_MAPPING[cfg.init["architecture"]](**fields).to_dict())
    return positions_in(read_config(cfg.path))


def position_problem(cfg: ModelSettings, max_length: int) -> tuple[str, str, str] | None:
    """("error" or "warn", what, the fix) when ``max_length`` runs past the model's positions."""
    limit, learned = position_limit(cfg)
    if limit is None or max_length <= limit:
        return None
    if learned:
        return ("error", f"data.max_length {max_length} exceeds the model's {limit} learned positions (its position table "
                f"has no row past {limit - 1})", f"set data.max_length: {limit} or less")
    return ("warn", f"data.max_length {max_length} runs past the {limit} positions the model declares (max_position_embeddings): "
            "its rotary positions go on, beyond what it was trained on", "lower data.max_length, or extend its context (rope_scaling)")


def check_positions(cfg: ModelSettings, max_length: int, warn: Callable[[str], None]) -> None:
    """Refuse rows longer than a learned position table (they would index past it mid-step), and say when
    rows run past the positions a rotary model declares."""
    problem = position_problem(cfg, max_length)
    if problem and problem[0] == "error":
        raise ConfigError(f"{problem[1]}; {problem[2]}")
    if problem:
        warn(f"{problem[1]}; {problem[2]}")


# the depth fields of a model's stacks: decoder-only, T5's encoder and decoder, BART's encoder and decoder
DEPTH_FIELDS = (("num_hidden_layers",), ("num_layers", "num_decoder_layers"), ("encoder_layers", "decoder_layers"))


def model_depth(cfg: ModelSettings) -> tuple[tuple[str, ...], int] | None:
    """The depth fields of the model's layer stacks and their one shared depth (an encoder-decoder:
    encoder and decoder layers; a plan extrapolates over them together), or None when that is not
    known or the stacks differ in depth."""
    fields = DEPTH_FIELDS[1:] if cfg.kind.encoder_decoder else DEPTH_FIELDS[:1]
    for names in fields:
        depths = {architecture_field(cfg, n) for n in names}
        if len(depths) == 1 and None not in depths:
            return names, depths.pop()
    return None


def build_model_skeleton(
    cfg: ModelSettings, tokenizer, compute_dtype: torch.dtype | None, activation_checkpointing: bool,
    layers: int | None = None,
) -> torch.nn.Module:
    """The run's model on the meta device (shapes and dtypes, no storage, nothing loaded), for a plan.

    The same architecture, storage dtypes, checkpointing and adapters as ``build_model``; a QLoRA
    base is left in the compute dtype (the plan accounts for its 4-bit storage itself), and
    attention is causal SDPA without a mask (memory linear in the row length, like the kernels training uses),
    or the stock implementation training uses where those kernels do not apply (``exact_attention``).
    ``layers``: build only this many layers in each stack (a plan extrapolates deep models from shallow ones).
    An encoder-decoder keeps the attention training uses: its encoder and cross-attention are not causal.
    """
    from transformers import AutoConfig

    base_dtype = storage_dtype(cfg, compute_dtype)
    if cfg.init is not None:
        config, base_dtype = init_config(cfg.init, tokenizer), torch.float32
    else:
        check_model_dir(cfg.path)
        config = AutoConfig.from_pretrained(str(cfg.path.resolve()), trust_remote_code=False)
        text = config.get_text_config()  # an image-text checkpoint's vocabulary is its language model's
        text.vocab_size = max(text.vocab_size, len(tokenizer))
    if layers is not None:
        depth = model_depth(cfg)
        for name in depth[0] if depth else ("num_hidden_layers",):
            setattr(config, name, layers)
        if isinstance(getattr(config, "layer_types", None), list):  # per-layer kinds (sliding / full attention)
            config.layer_types = config.layer_types[:layers]
    if cfg.kind.encoder_decoder:  # padded rows with a padding mask, as the run computes them
        attn = attention_implementation(cfg.attention, torch.device("cpu"), compute_dtype is not None, True, cfg.kind.model_type)
    else:
        # causal SDPA without a materialized mask, whose memory is linear in the row length as flash-attention's;
        # transformers' own sdpa path would build a row x row mask on fake tensors (it cannot see they need none)
        # a model whose attention the kernels do not compute (Gemma 2) runs transformers' stock one: so does its plan
        from .doc_attention import uncovered_attention
        from .packed_attention import register_causal

        uncovered = uncovered_attention(config)
        attn = uncovered[0] if uncovered else register_causal()
    settle_inputs(config)  # X-MOD's default language, as the run sets it
    with torch.device("meta"):
        model = model_class(cfg).from_config(config, dtype=base_dtype, attn_implementation=attn, trust_remote_code=False)
        return adapt(model, cfg, activation_checkpointing)


def nf4_config(compute_dtype: torch.dtype | None):
    """QLoRA's base: 4-bit NormalFloat with double quantization (the quantization constants
    quantized too), computing in the run's precision."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationUnavailable("model.method: qlora needs bitsandbytes: pip install 'trainforge[qlora]'")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype or torch.float32,
    )


class QuantizationUnavailable(TrainforgeError, RuntimeError):
    """QLoRA was asked for and bitsandbytes is not installed."""


def keep_norms_fp32(model: torch.nn.Module) -> None:
    """Normalization weights of a quantized base in fp32 (they are tiny; their statistics are
    where low precision hurts). This is the useful part of PEFT's ``prepare_model_for_kbit_training``,
    which also upcasts embeddings and the head to fp32 (gigabytes on a large vocabulary) and
    enables input gradients, which non-reentrant checkpointing does not need."""
    for name, module in model.named_modules():
        if "norm" in type(module).__name__.lower() or name.endswith("norm"):
            for param in module.parameters(recurse=False):
                param.data = param.data.float()


def one_weight_layout(model: torch.nn.Module) -> None:
    """Keep 4-bit weights in one layout. On CPUs with AVX512-BF16, bitsandbytes repacks a weight in
    place the first time it runs in eval mode without gradients, and matmuls in that layout round
    differently: training after an eval would then differ from training after a resume (which
    skips the eval before training), and resume would not be exact."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer in backward (transformers' ``GradientCheckpointingLayer``s).

    Non-reentrant ``torch.utils.checkpoint``: gradients reach LoRA adapters inside a layer whose
    input needs no gradient, and transformers wraps the layer's ``forward`` (not ``__call__``), so
    FSDP2's per-layer hooks stay outside the recomputation. Applied before LoRA, DDP and FSDP wrap
    the model, so each checkpointed layer is also one ``fully_shard`` unit.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"train.activation_checkpointing: {type(model).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before ~5.20 has only the older name (kept after as a deprecated alias)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def weight_storage(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Parameter counts by role and storage dtype: ``{"trainable": {"float32": n}, "frozen": {"bfloat16": m}}``.
    A 4-bit weight counts as ``nf4`` with the number of weights it holds."""
    out: dict[str, dict[str, int]] = {"trainable": {}, "frozen": {}}
    for param in model.parameters():
        role = "trainable" if param.requires_grad else "frozen"
        quant = getattr(param, "quant_state", None)  # a bitsandbytes 4-bit weight: packed bytes, original shape here
        kind, n = ("nf4", math.prod(quant.shape)) if quant is not None else (str(param.dtype).removeprefix("torch."), param.numel())
        out[role][kind] = out[role].get(kind, 0) + n
    return out


def describe_storage(storage: dict[str, dict[str, int]]) -> str:
    """``trainable fp32 (0.26M), frozen bf16 (12.3M)``: what each group of weights is stored in."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    parts = [
        f"{role} {short.get(kind, kind)} ({n / 1e6:.2f}M)"
        for role in ("trainable", "frozen")
        for kind, n in sorted(storage[role].items())
    ]
    return ", ".join(parts)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (a 4-bit weight counts the weights it holds)."""
    storage = weight_storage(model)
    trainable = sum(storage["trainable"].values())
    return trainable, trainable + sum(storage["frozen"].values())
