"""What a Hugging Face model is, read without loading it: a directory's config.json and files, an architecture's defaults.

Files are parsed once per version (resolved path, mtime, size, inode) and transformers configs built once
per architecture, however often a run asks for a model's kind.

A leaf at the package's top level, importing nothing of trainforge: the config schema, a low layer that
must not import ``model/``, resolves a run's model kind through it, and so do ``model/`` and the tools.
Kept under ``model/`` it would have made the schema reach up into a higher layer.
"""

from __future__ import annotations

import inspect
import json
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
# what a Hugging Face model directory holds (save_pretrained / a hub snapshot)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass(frozen=True)
class ModelKind:
    """What a run needs to know of its model before loading it."""

    model_type: str | None  # transformers' model_type (llama, t5, bart, ...); None where the directory names none
    encoder_decoder: bool  # T5, mT5, BART, ...: a source into the encoder, a target out of the decoder


def has_any(directory: Path, names: tuple[str, ...]) -> bool:
    """Whether ``directory`` holds a file of one of these names."""
    return any((directory / n).is_file() for n in names)


def read_config(path: str | Path | None) -> dict[str, Any]:
    """A model directory's config.json ({} when there is none or it is not a JSON object), parsed once per version."""
    return dict(_read_json(*_version(path, CONFIG)))


def model_kind(path: str | Path) -> ModelKind:
    """The kind of a model directory: its config.json's ``model_type`` and ``is_encoder_decoder`` (else its
    architecture's default); of an adapter directory (no config.json): PEFT's task type, and no model type."""
    config_file, config_version = _version(path, CONFIG)
    if config_version is None:
        adapter_file, adapter_version = _version(path, ADAPTER_CONFIG)
        if adapter_version is not None:  # PEFT's task type names the kind of its base
            return ModelKind(None, _read_json(adapter_file, adapter_version).get("task_type") == "SEQ_2_SEQ_LM")
    config = _read_json(config_file, config_version)
    model_type = config.get("model_type")
    if "is_encoder_decoder" in config:
        return ModelKind(model_type, bool(config["is_encoder_decoder"]))
    return ModelKind(model_type, architecture_is_encoder_decoder(model_type) if "model_type" in config else False)


def dir_is_encoder_decoder(path: str | Path) -> bool:
    """``is_encoder_decoder`` of a model directory (its config.json, else its architecture's default), or of
    an adapter directory (PEFT's task type); nothing is loaded."""
    return model_kind(path).encoder_decoder


def init_kind(init: dict[str, Any]) -> ModelKind:
    """The kind of a model built from scratch from ``{architecture: ..., <config fields>}``."""
    arch = init["architecture"]
    encoder_decoder = init["is_encoder_decoder"] if "is_encoder_decoder" in init else architecture_is_encoder_decoder(arch)
    return ModelKind(str(arch), bool(encoder_decoder))


@lru_cache(maxsize=None)
def architecture_is_encoder_decoder(arch: str) -> bool:
    """The default ``is_encoder_decoder`` of a transformers architecture (False for one transformers lacks)."""
    from transformers import CONFIG_MAPPING  # lazy: importing transformers costs seconds

    return bool(arch in CONFIG_MAPPING and getattr(CONFIG_MAPPING[arch](), "is_encoder_decoder", False))


def architectures() -> list[str]:
    """The architectures (``model_type`` names) transformers has configs for."""
    from transformers import CONFIG_MAPPING

    return list(CONFIG_MAPPING.keys())


def is_architecture(arch: Any) -> bool:
    """Whether transformers has a config for ``arch``."""
    from transformers import CONFIG_MAPPING

    return arch in CONFIG_MAPPING


@lru_cache(maxsize=None)
def known_config_fields(arch: str) -> frozenset[str]:
    """Field names a transformers config class accepts (constructor arguments and attributes)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    fields = set(cls().to_dict())
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            fields |= {p for p in inspect.signature(klass.__init__).parameters if p not in ("self", "kwargs")}
    fields |= set(getattr(cls, "attribute_map", {}))
    return frozenset(fields)


def _version(path: str | Path | None, name: str) -> tuple[str, tuple[int, int, int] | None]:
    """A file of a directory, resolved, and what tells its versions apart (None: no such regular file)."""
    try:
        file = (Path(path) / name).resolve()
        st = file.stat()
    except (OSError, TypeError, RuntimeError):
        return str(path), None
    return str(file), ((st.st_mtime_ns, st.st_size, st.st_ino) if stat.S_ISREG(st.st_mode) else None)


@lru_cache(maxsize=256)
def _read_json(file: str, version: tuple[int, int, int] | None) -> dict[str, Any]:
    """A JSON object file, cached per version; callers get it shared, to read (``read_config`` hands out copies)."""
    if version is None:
        return {}
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
