"""Typed run configuration: YAML file + `--set` overrides -> one validated RunConfig.

Every section forbids unknown keys. Errors name the full key (``train.micro_batch_size``),
the value given, what is allowed and, for YAML files, the file and line (``errors``).
The sections live beside this module (``data``, ``model``, ``train``, ...); ``--set`` parsing is ``overrides``.

A model's kind (encoder-decoder or not, its model type) is ``ModelSettings.kind``, read through ``hf_dir``
(each config.json parsed once per version, each architecture's defaults built once). An encoder-decoder's
unset ``data.packing`` resolves to false on the input, before validation: no validator changes a section.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from .base import MAX_STEPS, MAX_TOKENS, Section
from .data import BUILTIN_STDLIB, BUILTINS, DataSettings, SourceSpec
from .errors import ConfigError, clip, format_errors, key_lines
from .model import LoraSettings, ModelSettings, input_kind, is_encoder_decoder, model_type_of, validate_init_fields
from .optim import OptimSettings
from .presets import apply_presets
from .preference import PreferenceSettings, check_objective
from .rl import RLSettings, check_rl
from .train import TrainSettings, resolve_grad_accum, resolve_max_steps
from .overrides import apply_override, apply_overrides, parse_override
from .yaml_text import load_yaml, read_config_text
from ..hf_dir import TOKENIZER_FILES, WEIGHT_FILES, ModelKind, dir_is_encoder_decoder

# the whole config importable from here (the data section's names from .data)
__all__ = [
    "TOKENIZER_FILES", "WEIGHT_FILES", "CheckpointSettings", "ConfigError",
    "LogSettings", "LoraSettings", "ModelKind", "ModelSettings", "OptimSettings",
    "RunConfig", "Section", "TrainSettings", "apply_override", "default_config",
    "dir_is_encoder_decoder", "is_encoder_decoder", "load_config", "model_type_of", "parse_override",
    "resolve_grad_accum", "resolve_max_steps", "validate_init_fields",
]


class CheckpointSettings(Section):
    """Checkpoints go to `checkpoints/step-NNNNNNNN/` in the run directory; `trainforge train` resumes
    from the newest complete one (`--resume auto`). With either interval set, one is also saved at the end.
    """

    # "async" is a Python keyword: the attribute is async_, the key users write is "async"
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)

    every_steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="save a checkpoint every N steps (and at the end)")
    every_minutes: float | None = Field(
        30.0, gt=0, le=10**7, description="save a checkpoint when this many minutes passed since the last one; null: off"
    )
    keep_last: int = Field(3, ge=1, le=10**6, description="checkpoints kept; older ones deleted after a newer one is complete")
    async_: bool = Field(
        False,
        alias="async",
        description="copy the state off the training path and write it in a background thread (pause: the copy)",
    )


class LogSettings(Section):
    every_steps: int = Field(10, gt=0, le=MAX_STEPS, description="write metrics.jsonl and the console line every N steps")
    sample_prompt: str | None = Field(None, description="after training, print a sample continuing this prompt")
    sample_tokens: int = Field(64, gt=0, le=MAX_TOKENS, description="length of that sample")
    profile_steps: list[int] = Field(
        default_factory=list,
        description="steps to profile: time split into data/forward/backward/optimizer, and a torch profiler "
        f"trace in profile/ of the run directory (each > 0, <= {MAX_STEPS})",
    )
    tensorboard: bool = Field(
        True,
        description="also write metrics as TensorBoard scalars (tb/) when tensorboard is installed; "
        "only read when log.report_to is not set (the older spelling of report_to: [tensorboard])",
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="trackers that get the metrics.jsonl scalars, the config and summary.json (rank 0 only): "
        "tensorboard (tb/ in the run directory), wandb (offline into the run directory unless logged in or "
        "WANDB_MODE is set; pip install 'trainforge[wandb]'), mlflow (./mlruns unless MLFLOW_TRACKING_URI is set; "
        "pip install 'trainforge[mlflow]'); [] for none. Unset: tensorboard when installed (see log.tensorboard)",
    )
    project: str = Field("trainforge", min_length=1, description="the W&B project and MLflow experiment runs log to")
    report: bool = Field(
        True, description="write report.html (plots of the run) into the run directory at the end, also when stopped by a signal"
    )
    example_indices: bool = Field(
        False, description="add to each train record the example indices of every step since the previous one"
    )

    @field_validator("profile_steps")
    @classmethod
    def _steps_in_range(cls, v: list[int]) -> list[int]:
        if any(not 0 < step <= MAX_STEPS for step in v):
            raise ValueError(f"each step must be > 0 and <= {MAX_STEPS}")
        return v

    @field_validator("report_to")
    @classmethod
    def _unique_trackers(cls, v: list[str] | None) -> list[str] | None:
        return list(dict.fromkeys(v)) if v is not None else None

    def trackers(self) -> list[str]:
        """The trackers this run logs to: ``report_to``, else TensorBoard when ``tensorboard`` is on."""
        if self.report_to is not None:
            return list(self.report_to)
        return ["tensorboard"] if self.tensorboard else []


class RunConfig(Section):
    model: ModelSettings
    data: DataSettings
    train: TrainSettings = Field(default_factory=TrainSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)
    preference: PreferenceSettings = Field(default_factory=PreferenceSettings)
    rl: RLSettings = Field(default_factory=RLSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    preset: Literal["smoke", "production"] | None = Field(
        None,
        description="a named overlay: smoke (20 steps on a small share of the data, eval and checkpoint once, "
        "nothing compiled: proves a config in about a minute) or production (compile auto, async checkpoints "
        "every 30 minutes, eval_every auto); the file's own keys override it, --preset on the command line "
        "lays it over the file",
    )

    @model_validator(mode="before")
    @classmethod
    def _packing_follows_the_model_kind(cls, raw: Any) -> Any:
        """An encoder-decoder trains one source -> target example per row, and a model with recurrent layers (Mamba,
        linear attention) cannot keep packed documents apart: an unset ``data.packing`` resolves to false on (a copy
        of) the input, before validation; no validator changes a section, config.yaml says false. Whether a model's
        stock attention keeps them apart (Falcon's does, GPT-OSS's not) is measured at setup
        (``engine/packing_check``)."""
        if not isinstance(raw, dict):
            return raw
        data = raw.get("data")
        if isinstance(data, DataSettings):
            unset = "packing" not in data.model_fields_set
        else:
            unset = isinstance(data, dict) and "packing" not in data
        kind = input_kind(raw.get("model")) if unset else None
        if kind is None or not (kind.encoder_decoder or kind.recurrent):
            return raw
        resolved = data.model_copy(update={"packing": False}) if isinstance(data, DataSettings) else {**data, "packing": False}
        return {**raw, "data": resolved}

    @model_validator(mode="after")
    def _fits_the_model_kind(self) -> "RunConfig":
        """Settings that depend on whether the model is decoder-only or encoder-decoder (T5, BART, ...)."""
        d, kind = self.data, self.model.kind
        check_objective(self)
        check_rl(self)
        if not kind.encoder_decoder:
            if kind.recurrent and d.packing is True:  # given: an unset one resolved to false
                raise ValueError(
                    f"data.packing: the model ({kind.model_type}) has {kind.recurrent} layers, whose state runs along the "
                    "row past any position reset: documents packed into one row would read each other; set "
                    "data.packing: false (one example per row, batches grouped by length) or leave it unset; "
                    "'concat' (text as one stream, for pretraining) is fine"
                )
            if d.max_target_length is not None:
                raise ValueError(
                    "data.max_target_length: only encoder-decoder models (T5, BART, ...) have a separate target; "
                    "this model is decoder-only: data.max_length limits the whole example"
                )
            return self
        what = f"the model ({kind.model_type or 'encoder-decoder'}) is an encoder-decoder"
        if d.max_length == "auto":  # a source length and a target length: no one longest row to search for
            raise ValueError(f"data.max_length: auto is for decoder-only models; {what}: give data.max_length (source "
                             "tokens) and data.max_target_length as numbers")
        if d.packing is not False:  # given (an unset one resolved to false): packing across examples would need
            raise ValueError(  # per-document cross-attention
                f"data.packing: {what}; it trains one source -> target example per row, batches grouped by "
                "length and padded (no packing across examples); set data.packing: false or leave it unset"
            )
        problems = {
            "data.too_long": "split is for text only; use truncate or drop" if d.too_long == "split" else None,
            next((key for key, fmt in d.set_formats() if fmt == "text"), "data.format"): "text rows have no source -> "
            "target pairs; use prompt_completion, source_target, alpaca or chat rows"
            if any(fmt == "text" for _, fmt in d.set_formats()) else None,
            "data.train_on_prompt": "the encoder reads the source and only the target is learned; set it to false"
            if d.train_on_prompt else None,
            "model.attention": f"{self.model.attention} is for packed decoder-only rows; use auto, sdpa or eager"
            if self.model.attention in ("packed_sdpa", "varlen", "flex") else None,
        }
        for key, problem in problems.items():
            if problem:
                raise ValueError(f"{key}: {what}: {problem}")
        return self

    def row_tokens(self) -> int:
        """Tokens one row holds at most: ``data.max_length``, plus the target side of an encoder-decoder, or (grpo)
        a completion behind its prompt (rl/stage.py packs rows of that capacity)."""
        if self.model.kind.encoder_decoder:
            return self.data.row_length() + self.data.target_limit()
        return self.data.row_length() + (self.rl.max_completion_length if self.train.objective == "grpo" else 0)

    def to_yaml(self) -> str:
        """The resolved configuration as YAML (every default spelled out)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def anchored(self) -> RunConfig:
        """This config with its local paths made absolute (model, tokenizer, data, cache), as a run
        directory's config.yaml keeps it: generate, eval, export and doctor then find the base model and
        the data from any working directory, not only the one the run started in."""

        def local(spec):
            if isinstance(spec, SourceSpec):
                return spec.model_copy(update={"path": local(spec.path)})
            if isinstance(spec, list):
                return [local(s) for s in spec]
            if isinstance(spec, Path) or (isinstance(spec, str) and spec not in BUILTINS and "://" not in spec):
                return type(spec)(os.path.abspath(spec))
            return spec  # a built-in corpus, an eval fraction, None

        def local_dir(path):  # model.path / model.tokenizer: a directory, or None, or tokenizer "char"
            return Path(os.path.abspath(path)) if isinstance(path, Path) else path

        m, d = self.model, self.data
        model = m.model_copy(update={"path": local_dir(m.path), "tokenizer": local_dir(m.tokenizer)})
        data = d.model_copy(update={"train": local(d.train), "eval": local(d.eval), "cache_dir": local(d.cache_dir)})
        return self.model_copy(update={"model": model, "data": data})


def default_config() -> dict[str, Any]:
    """The built-in default: a small Llama from scratch on the standard library's sources.

    Needs no download and trains on 2 CPU cores in about three minutes.
    """
    return {
        "model": {
            "init": {
                "architecture": "llama",
                "hidden_size": 128,
                "intermediate_size": 384,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "max_position_embeddings": 256,
            },
            "tokenizer_vocab_size": 2048,
        },
        "data": {
            "train": BUILTIN_STDLIB,
            "eval": 0.05,
            "max_length": 256,  # packing: left to the model's kind (true for this Llama; false where --set names a Mamba)
            "max_documents": 300,
        },
        "train": {"max_steps": 600, "micro_batch_size": 8, "eval_every": 200},
        "optim": {"lr": 2.0e-3, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 50},
        "log": {"every_steps": 50, "sample_prompt": "def ", "sample_tokens": 60},
    }


# ---------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), plan_only: bool = False,
    preset: str | None = None,
) -> RunConfig:
    """Read a YAML config (or the built-in default), apply its presets, then ``--set`` overrides, validate.

    ``plan_only``: for ``trainforge plan``, a ``model.path`` needs only its config.json.
    ``preset``: ``--preset NAME``, laid over the file (config/presets.py says how presets layer)."""
    marks: dict[tuple[str, ...], int] = {}
    if path is None:
        data = default_config()
        source = "built-in default config"
    else:
        path = Path(path)
        source = str(path)
        data, node = load_yaml(read_config_text(path), clip(source))
        data = data or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{clip(source)}: the top level must be a mapping of sections (model, data, train, ...)")
        marks = key_lines(node)
    data = apply_presets(copy.deepcopy(data), preset, file_is_user=path is not None)
    overridden = apply_overrides(data, overrides)
    try:
        return RunConfig.model_validate(data, context={"plan": plan_only})
    except ValidationError as e:
        raise ConfigError(format_errors(e, data, source, marks, overridden, RunConfig)) from None
