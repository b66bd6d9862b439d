"""The model section of a run config: which model (a directory or from scratch), its tokenizer, training method and kind.

Its validators check paths and a model directory's files (``hf_dir``: stat calls only) and ``model.init``'s
fields against the architecture's transformers config (built once per architecture). ``ModelSettings.kind``
is the model's kind, resolved through ``hf_dir``, which parses a config.json once per version.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .. import hf_dir, hf_weights
from .base import MAX_TOKENS, Section
from .errors import clip, shown
from ..hf_dir import TOKENIZER_FILES, WEIGHT_FILES, ModelKind
from ..model.moe import routing_problem


def _check_exists(path: Path | None, key: str) -> Path | None:
    if path is not None and not _exists(path):
        raise ValueError(f"path does not exist: {clip(str(path))} (give an existing local directory for {key})")
    return path


def _exists(path: str | os.PathLike) -> bool:
    """``Path(path).exists()``; a ``ValueError`` (a validation error) where the name cannot be looked up."""
    try:
        return Path(path).exists()
    except OSError as e:  # a name too long for the file system
        raise ValueError(f"cannot use {shown(str(path))}: {e.strerror}") from None


class LoraSettings(Section):
    r: int = Field(16, gt=0, le=2**16, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: str | list[str] = Field(
        "all-linear", description="'all-linear' (every linear layer of the blocks) or module names"
    )
    use_dora: bool = Field(False, description="DoRA: adapters on the direction, plus a trained magnitude per output")
    use_rslora: bool = Field(False, description="rank-stabilized LoRA: scale updates by alpha / sqrt(r) instead of alpha / r")
    fused: bool = Field(
        True, description="add each adapter's update inside the GEMM (no fp32 copy of the layer input, no extra passes "
        "over its output; the same function and files); false: PEFT's own forward"
    )


class ModelSettings(Section):
    path: Path | None = Field(None, description="local Hugging Face model directory")
    init: dict[str, Any] | None = Field(
        None, description="from scratch: {architecture: llama, ...any field of that transformers config}"
    )
    tokenizer: Literal["char"] | Path | None = Field(
        None,
        description="local tokenizer directory (default: model.path), or char: a character vocabulary "
        "(the training text's characters plus EOS, PAD and UNK) built from the data",
    )
    tokenizer_vocab_size: int = Field(
        8192, ge=260, le=MAX_TOKENS, description="vocabulary of the BPE tokenizer trained on the data when there is none"
    )
    method: Literal["full", "lora", "qlora"] = Field(
        "full",
        description="full: train every weight; lora: train PEFT adapters on a frozen base (stored in the run's "
        "precision); qlora: the same on a 4-bit NF4 base (bitsandbytes)",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    router_aux_loss: bool | float = Field(
        True, description="mixture-of-experts models: add the router load-balancing loss times the config's "
        "router_aux_loss_coef to the training loss, as transformers does with output_router_logits (logged as aux_loss); "
        "a number: that coefficient in place of the config's (e.g. 0.01); false: cross-entropy only",
    )
    router_z_loss: bool = Field(
        True, description="mixture-of-experts models whose transformers model adds a router z-loss (Switch "
        "Transformers; no decoder-only family of transformers 5 has one): add router_z_loss_coef x the z-loss "
        "(the mean squared logsumexp of the router logits over real tokens), logged as z_loss; false: leave it out",
    )
    experts_implementation: Literal["auto", "eager", "batched_mm", "grouped_mm"] = Field(
        "auto", description="mixture-of-experts models: how transformers runs the routed experts. grouped_mm: tokens "
        "sorted by expert, one grouped GEMM (torch's kernel on CUDA sm80+ with bf16 weights; a loop of GEMMs elsewhere); "
        "eager: a Python loop over the experts hit; batched_mm: one weight matrix gathered per routed token (for "
        "decoding: its memory grows with tokens x experts per token). auto: grouped_mm, except eager on a GPU whose "
        "expert weights are not bf16 (a full fine-tune's fp32 masters: eager's matmuls get autocast's bf16)",
    )
    attention: Literal["auto", "sdpa", "packed_sdpa", "varlen", "flex", "eager", "flash_attention_2"] = Field(
        "auto",
        description="attention kernel; auto: on CUDA varlen (torch's built-in Flash varlen kernel over packed "
        "documents; sm80+, bf16/fp16), else flex (FlexAttention with a document mask); on CPU packed_sdpa "
        "(packed documents batched by length, causal SDPA). None builds a row x row mask. Encoder-decoders: sdpa",
    )

    @field_validator("router_aux_loss", mode="before")
    @classmethod
    def _not_a_bare_0_or_1(cls, v: Any) -> Any:
        # a bare 0 or 1 reads as a switch in YAML's habits and as a coefficient here: neither guess is safe
        if type(v) is int and v in (0, 1):
            raise ValueError(f"{v} is ambiguous: write true or false to switch the load-balancing loss on or off, or "
                             f"{v}.0 for a coefficient")
        return v

    @field_validator("router_aux_loss")
    @classmethod
    def _coefficient(cls, v: bool | float) -> bool | float:
        if not isinstance(v, bool) and not 0 <= v <= 1000:  # (nan and inf fail the float type before this)
            raise ValueError(f"a coefficient is a number from 0 to 1000 (got {v}); or true (the model config's "
                             "router_aux_loss_coef) or false (off)")
        return v

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: Path | None) -> Path | None:
        return _check_exists(v, "model.path")

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer_exists(cls, v: Any) -> Any:
        if v is None or v == "char":
            return v
        if not isinstance(v, (str, os.PathLike)):
            raise ValueError("expected a local tokenizer directory or 'char' (a character vocabulary built from the data)")
        if not _exists(v):
            raise ValueError(f"path does not exist: {clip(str(v))} (give an existing local tokenizer directory, or 'char')")
        return v

    @field_validator("init")
    @classmethod
    def _init_fields_known(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            validate_init_fields(v)
        return v

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo) -> "ModelSettings":
        if (self.path is None) == (self.init is None):
            raise ValueError("give exactly one of model.path (a pretrained model) or model.init (from scratch)")
        if self.method in ("lora", "qlora") and self.path is None:
            raise ValueError(f"model.method: {self.method} needs a pretrained model.path to adapt; use 'full' with model.init")
        if self.method == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("model.method: qlora needs bitsandbytes for the 4-bit base: pip install 'trainforge[qlora]'")
        if self.path is not None:
            # a plan needs the architecture only: a directory with just the hub's config.json will do
            plan_only = bool(info.context and info.context.get("plan"))
            _check_model_dir(self.path, needs_tokenizer=self.tokenizer is None and not plan_only, needs_weights=not plan_only)
            _refuse_custom_code(self.path, "model.path")
            problem = routing_problem(hf_dir.read_config(self.path))
            if problem is not None:
                raise ValueError(f"model.path: {self.path}/config.json: {problem}; fix the directory's config.json")
            _check_weights(self.path)
        if isinstance(self.tokenizer, Path) and self.tokenizer.is_dir() and not hf_dir.has_any(self.tokenizer, TOKENIZER_FILES):
            raise ValueError(
                f"model.tokenizer: {self.tokenizer} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                "save one there with tokenizer.save_pretrained(dir)"
            )
        if isinstance(self.tokenizer, Path):
            _refuse_custom_code(self.tokenizer, "model.tokenizer")
        return self

    @property
    def kind(self) -> ModelKind:
        """The model's kind (encoder-decoder or not, its ``model_type``), from ``model.init`` or the directory's
        config.json (an adapter directory: PEFT's task type), read once per version of the file; nothing is loaded."""
        return hf_dir.init_kind(self.init) if self.init is not None else hf_dir.model_kind(self.path)


def _check_model_dir(path: Path, needs_tokenizer: bool, needs_weights: bool = True) -> None:
    """``model.path`` must be a model directory: a config, weights and (unless given apart) a tokenizer."""
    if not path.is_dir():
        raise ValueError(f"model.path: {path} is not a directory; give a local Hugging Face model directory")
    missing = []
    if not hf_dir.has_any(path, (hf_dir.CONFIG, hf_dir.ADAPTER_CONFIG)):
        missing.append("config.json")
    if needs_weights and not hf_dir.has_any(path, WEIGHT_FILES):
        missing.append("weights (model.safetensors or pytorch_model.bin)")
    if needs_tokenizer and not hf_dir.has_any(path, TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(TOKENIZER_FILES)}; or set model.tokenizer)")
    if missing and (path / "config.yaml").is_file() and any((path / p).exists() for p in ("final", "checkpoints", "metrics.jsonl")):
        raise ValueError(_run_dir_hint(path))
    if missing:
        raise ValueError(
            f"model.path: {path} is not a Hugging Face model directory; it lacks {', '.join(missing)}. "
            "Save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir), or download a hub "
            "snapshot there beforehand (nothing is downloaded at run time)"
        )


def _check_weights(path: Path) -> None:
    """``hf_weights.check_weights`` at validation, before any data is prepared or a run directory made (a plan reads
    the headers too). An adapter directory is left to ``refuse_adapter``, which says to merge it first."""
    if hf_dir.has_any(path, (hf_dir.ADAPTER_CONFIG,)) and not hf_dir.has_any(path, (hf_dir.CONFIG,)):
        return
    try:
        hf_weights.check_weights(path)
    except hf_weights.DamagedWeights as e:
        raise ValueError(f"model.path: {e}") from None


def _run_dir_hint(run: Path) -> str:
    """``model.path`` at a trainforge run directory (which generate, eval and export take): where its model is."""
    final = run / "final"
    head = f"model.path: {run} is a trainforge run directory, not a model directory; "
    if hf_dir.has_any(final, (hf_dir.CONFIG,)):
        return head + f"its model is {final}: set model.path: {final}"
    if hf_dir.has_any(final, (hf_dir.ADAPTER_CONFIG,)):
        return head + (f"its final/ is an adapter: merge it into its base first, `trainforge export {run} --merge --out DIR`, "
                       "and set model.path: DIR")
    return head + f"it has no final/ model yet (the run has not finished): finish it with the same train command and --output {run}"


def _refuse_custom_code(path: Path, key: str) -> None:
    """``hf_dir.refuse_custom_code`` at validation, before any data is prepared: its message under ``key``."""
    try:
        hf_dir.refuse_custom_code(path)
    except hf_dir.UnsupportedModelDir as e:
        raise ValueError(f"{key}: {e}") from None


def model_type_of(model: ModelSettings) -> str | None:
    """The transformers ``model_type`` of the configured model (``llama``, ``t5``, ``bart``, ...): ``model.kind.model_type``."""
    return model.kind.model_type


def is_encoder_decoder(model: ModelSettings) -> bool:
    """Whether the configured model is an encoder-decoder (T5, mT5, BART, ...): ``model.kind.encoder_decoder``."""
    return model.kind.encoder_decoder


def validate_init_fields(init: dict[str, Any]) -> None:
    """Check ``model.init``: a known architecture and only fields its transformers config has."""
    arch = init.get("architecture")
    if arch is None:
        raise ValueError("model.init needs 'architecture' (for example: llama)")
    if not isinstance(arch, str) or not hf_dir.is_architecture(arch):
        close = difflib.get_close_matches(clip(str(arch)), hf_dir.architectures(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"model.init.architecture: unknown architecture {shown(arch)}{hint}")
    known = hf_dir.known_config_fields(arch)
    for key in init:
        if key != "architecture" and key not in known:
            close = difflib.get_close_matches(clip(str(key)), sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"model.init.{clip(str(key))}: not a field of the {arch} config{hint}")
    bad = _non_finite(init)
    if bad is not None:
        raise ValueError(f"model.init.{bad}: must be a finite number (not inf or nan)")
    problem = routing_problem({**init, **hf_dir.built_config(init)})  # the user's keys first, then the defaults
    if problem is not None:
        raise ValueError(f"model.init: {problem}")


def _non_finite(value: Any, path: str = "") -> str | None:
    """The key path (``rope_scaling.factor``) of the first inf or nan float in ``value``, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        bad = _non_finite(v, f"{path}.{k}" if path else str(k))
        if bad is not None:
            return clip(bad)
    return None


def input_kind(model: Any) -> ModelKind | None:
    """The kind of the model a model section, not yet validated, names (None where validation will reject it)."""
    if isinstance(model, ModelSettings):
        return model.kind
    if not isinstance(model, dict):
        return None
    path, init = model.get("path"), model.get("init")
    try:
        if init is None and isinstance(path, (str, os.PathLike)):
            return hf_dir.model_kind(path)
        if path is None and isinstance(init, dict) and isinstance(init.get("architecture"), str):
            return hf_dir.init_kind(init)
    except Exception:  # an architecture transformers cannot build: the model section's own validator says so
        pass
    return None
