"""What ``generate``, ``eval`` and ``export`` accept, and how they load it.

Three kinds of directory name a model:

- a **run directory** (``config.yaml`` and ``final/``; also its ``final/`` named directly): the
  model is ``final/``, loaded the way the run trained it (the run's precision, a LoRA base stored
  in it, a QLoRA base in 4-bit NF4), so what is measured is what the run measured;
- a **Hugging Face model directory** (``config.json`` and weights);
- a **PEFT adapter directory** (``adapter_config.json``; its base is the local directory named by
  ``base_model_name_or_path``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.yaml_text import load_yaml, read_config_text
from ..errors import TrainforgeError
from ..hardware.device import Precision
from ..hf_dir import TOKENIZER_FILES, dir_is_encoder_decoder, has_any, model_kind, refuse_custom_code
from ..hf_weights import check_weights

RUN_CONFIG = "config.yaml"
FINAL = "final"
SUMMARY = "summary.json"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class ModelSourceError(TrainforgeError, ValueError):
    """The path is not a run, model or adapter directory (the message names what it lacks)."""


@dataclass
class ModelSource:
    """A resolved model: where its weights are, and what the run that made it said about it."""

    path: Path  # as the user gave it
    weights: Path  # the directory holding the weights: final/, a model directory or an adapter directory
    run_dir: Path | None = None
    run_config: dict[str, Any] | None = None  # the run's config.yaml (resolved, every key present)
    summary: dict[str, Any] = field(default_factory=dict)
    adapter: dict[str, Any] | None = None  # adapter_config.json
    base: Path | None = None  # an adapter's base model directory
    tokenizer_dir: Path | None = None

    @property
    def method(self) -> str:
        """full, lora or qlora (an adapter outside a run counts as lora)."""
        if self.run_config is not None:
            return self.run_config.get("model", {}).get("method", "full")
        return "lora" if self.adapter is not None else "full"

    @property
    def encoder_decoder(self) -> bool:
        """An encoder-decoder (T5, BART, ...): its config's ``is_encoder_decoder`` (an adapter's: its base's)."""
        return dir_is_encoder_decoder(self.base or self.weights)

    @property
    def model_type(self) -> str | None:
        """The model's ``model_type`` (an adapter's: its base's)."""
        return model_kind(self.base or self.weights).model_type

    @property
    def quantized(self) -> bool:
        """The run trained its adapters on a 4-bit NF4 base (QLoRA)."""
        return self.method == "qlora"

    def describe(self) -> str:
        what = f"run {self.run_dir}" if self.run_dir else str(self.weights)
        kind = {"full": "full model", "lora": "LoRA adapter", "qlora": "QLoRA adapter"}[self.method]
        return f"{what} ({kind}" + (f" on {self.base})" if self.base else ")")


def resolve_source(path: str | Path) -> ModelSource:
    """Find the model that ``path`` names; ``ModelSourceError`` says what is missing."""
    path = Path(path)
    if not path.exists():
        raise ModelSourceError(f"{path}: no such directory; give a run directory, a Hugging Face model directory or a LoRA adapter directory")
    if not path.is_dir():
        raise ModelSourceError(f"{path} is a file; give a run directory, a Hugging Face model directory or a LoRA adapter directory")
    run_dir = None
    if (path / RUN_CONFIG).is_file():
        run_dir = path
        if not (path / FINAL).is_dir():
            raise ModelSourceError(
                f"{path} is a run directory without final/: the run has not finished. Resume it with "
                f"`trainforge train CONFIG --output {path}` (its checkpoints/ are not a model directory)"
            )
        weights = path / FINAL
    elif path.name == FINAL and (path.parent / RUN_CONFIG).is_file():
        run_dir, weights = path.parent, path
    else:
        weights = path
    src = ModelSource(path=path, weights=weights, run_dir=run_dir)
    if run_dir is not None:
        config_path = run_dir / RUN_CONFIG  # read with the limits of a user's config: a run directory may be anyone's
        src.run_config = load_yaml(read_config_text(config_path), str(config_path))[0] or {}
        if (run_dir / SUMMARY).is_file():
            src.summary = json.loads((run_dir / SUMMARY).read_text())

    if (weights / ADAPTER_CONFIG).is_file():
        src.adapter = json.loads((weights / ADAPTER_CONFIG).read_text())
        if not has_any(weights, ADAPTER_WEIGHTS):
            raise ModelSourceError(f"{weights} has adapter_config.json but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
        src.base = _adapter_base(src)
    else:
        missing = []
        if not (weights / "config.json").is_file():
            missing.append("config.json")
        if not has_any(weights, MODEL_WEIGHTS):
            missing.append("weights (model.safetensors or pytorch_model.bin)")
        if missing:
            raise ModelSourceError(
                f"{weights} is not a model directory: it lacks {' and '.join(missing)}. Give a run directory "
                "(config.yaml + final/), a Hugging Face model directory (config.json + weights) or a LoRA adapter "
                "directory (adapter_config.json + adapter weights)"
            )
    # never run a directory's code (auto_map) nor guess at an architecture transformers lacks; loads pass
    # trust_remote_code=False besides, so transformers can neither prompt nor import the directory's files
    refuse_custom_code(weights)
    check_weights(weights)  # a damaged header or a pickle that needs code: refused before anything loads (or is copied)
    if src.base is not None:
        refuse_custom_code(src.base)
        check_weights(src.base)
    src.tokenizer_dir = _tokenizer_dir(src)
    if src.tokenizer_dir not in (weights, src.base):
        refuse_custom_code(src.tokenizer_dir)
    return src


def _adapter_base(src: ModelSource) -> Path:
    """The adapter's base model directory: the run's model.path, else adapter_config.json's (the first
    that is a local model directory: a run started elsewhere wrote a path relative to its directory)."""
    names = [(src.run_config or {}).get("model", {}).get("path"), src.adapter.get("base_model_name_or_path")]
    names = [n for n in names if n]
    if not names:
        raise ModelSourceError(f"{src.weights / ADAPTER_CONFIG} names no base model (base_model_name_or_path is empty)")
    for named in names:
        base = Path(named)
        if (base / "config.json").is_file() and has_any(base, MODEL_WEIGHTS):
            return base
    raise ModelSourceError(
        f"the adapter in {src.weights} adapts {' or '.join(dict.fromkeys(names))}, which is not a local model directory "
        f"(config.json + weights); nothing is downloaded: put the base model there, or set base_model_name_or_path in {ADAPTER_CONFIG}"
    )


def _tokenizer_dir(src: ModelSource) -> Path:
    configured = (src.run_config or {}).get("model", {}).get("tokenizer")
    for candidate in (src.weights, src.base, Path(configured) if configured and configured != "char" else None):
        if candidate is not None and has_any(candidate, TOKENIZER_FILES):
            return candidate
    raise ModelSourceError(f"{src.weights} has no tokenizer files ({', '.join(TOKENIZER_FILES)})" + (f", nor has its base {src.base}" if src.base else ""))


def load_source_tokenizer(src: ModelSource):
    """The tokenizer saved with the model (an adapter's base's when the adapter has none)."""
    from .tokenizer import load_tokenizer

    return load_tokenizer(src.tokenizer_dir)


def run_precision(src: ModelSource) -> str | None:
    """The precision the run computed in (summary.json), if ``src`` is a finished run."""
    return src.summary.get("precision")


def load_model(
    src: ModelSource,
    device: torch.device,
    precision: Precision,
    vocab_size: int | None = None,
    attention: str | None = None,
    quantized: bool | None = None,
) -> torch.nn.Module:
    """The model in eval mode on ``device``, stored as the run trained it.

    Full weights: fp32 for a run's ``final/`` (the run kept fp32 master weights and computed under
    autocast), else in ``precision``'s compute dtype. An adapter's frozen base is stored in the
    compute dtype (as LoRA training stores it) or, for QLoRA (``quantized``, default: the run's
    method), loaded in 4-bit NF4 as the run trained it; the adapters themselves load in fp32.
    ``vocab_size``: the tokenizer's size; a base with fewer embeddings is resized, as training did.
    ``attention``: the run's ``model.attention`` (default ``auto``, the same rule as training).
    """
    from .inputs import settle_inputs
    from .load import attention_implementation, auto_model_class, keep_norms_fp32, nf4_config, one_weight_layout

    if attention is None:
        attention = (src.run_config or {}).get("model", {}).get("attention", "auto")
    auto_class = auto_model_class(src.encoder_decoder, src.model_type)  # AutoModelForSeq2SeqLM for T5, BART, ...
    attn = attention_implementation(attention, device, precision.autocast_dtype is not None, src.encoder_decoder,
                                    src.model_type)
    compute = precision.autocast_dtype or torch.float32
    if src.adapter is None:
        dtype = torch.float32 if src.run_dir is not None else compute
        model = auto_class.from_pretrained(str(src.weights), dtype=dtype, attn_implementation=attn, trust_remote_code=False)
        settle_inputs(model.config)  # X-MOD's only language, as training settles it (a run's final/ has it already)
        return model.to(device).eval()

    from peft import PeftModel

    quantized = src.quantized if quantized is None else quantized
    extra = {"quantization_config": nf4_config(precision.autocast_dtype)} if quantized else {}
    base = auto_class.from_pretrained(str(src.base), dtype=compute, attn_implementation=attn, trust_remote_code=False, **extra)
    settle_inputs(base.config)  # the base as the adapter trained on it (X-MOD's language): a merged export keeps it
    if vocab_size is not None and base.get_input_embeddings().num_embeddings < vocab_size:
        base.resize_token_embeddings(vocab_size)
    if quantized:
        keep_norms_fp32(base)
        one_weight_layout(base)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # the adapter's task type picks PEFT's class (PeftModelForSeq2SeqLM for SEQ_2_SEQ_LM adapters)
        model = PeftModel.from_pretrained(base, str(src.weights), is_trainable=False)
    for name, param in model.named_parameters():  # adapters in fp32, as they trained (peft upcasts them from bf16/fp16 too)
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()
    return model.to(device).eval()
