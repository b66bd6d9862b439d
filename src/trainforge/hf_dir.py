"""What a Hugging Face model is, read without loading it: a directory's config.json and files, an architecture's defaults.

Files are parsed once per version (resolved path, mtime, size, inode) and transformers configs built once
per architecture, however often a run asks for a model's kind.

``refuse_custom_code`` is the one check that a directory about to be loaded needs no code of its own
(``auto_map`` naming Python files of the directory, or a ``model_type`` transformers does not ship): trainforge
never runs code from a model or tokenizer directory (docs/security.md); every loader calls it first.

A leaf at the package's top level, importing nothing of trainforge but the error base: the config schema, a low
layer that must not import ``model/``, resolves a run's model kind through it, and so do ``model/`` and the tools.
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

from .errors import TrainforgeError

CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# what a Hugging Face model directory holds (save_pretrained / a hub snapshot)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass(frozen=True)
class ModelKind:
    """What a run needs to know of its model before loading it."""

    model_type: str | None  # transformers' model_type (llama, t5, bart, ...); None where the directory names none
    encoder_decoder: bool  # T5, mT5, BART, ...: a source into the encoder, a target out of the decoder
    recurrent: str | None = None  # layers whose state runs along the sequence (Mamba, linear attention): what they are
    fixed_attention: str | None = None  # why its attention takes no attention function by name (Falcon): no packing


# model types whose layers carry a state along the sequence, past any position reset: Mamba / SSM mixers,
# linear attention, RWKV, xLSTM, RG-LRU; packed documents would read each other through it
RECURRENT_MODEL_TYPES = {
    "mamba": "Mamba", "mamba2": "Mamba", "falcon_mamba": "Mamba", "falcon_h1": "Mamba", "jamba": "Mamba",
    "zamba": "Mamba", "zamba2": "Mamba", "bamba": "Mamba", "granitemoehybrid": "Mamba", "nemotron_h": "Mamba",
    "lfm2": "short-convolution", "lfm2_moe": "short-convolution", "qwen3_next": "linear-attention",
    "minimax": "linear-attention", "kimi_linear": "linear-attention", "olmo_hybrid": "linear-attention",
    "rwkv": "RWKV", "xlstm": "xLSTM", "recurrent_gemma": "recurrent",
}  # fmt: skip
_RECURRENT_WORDS = (("mamba", "Mamba"), ("ssm", "Mamba"), ("linear_attention", "linear-attention"),
                    ("deltanet", "linear-attention"), ("conv", "short-convolution"), ("recurrent", "recurrent"))


def recurrent_layers(config: dict[str, Any]) -> str | None:
    """What layers of this config.json carry a state along the sequence ("Mamba", "linear-attention", ...), else None:
    its model type, Mamba/SSM fields (``mamba_d_state``, ``ssm_state_size``), or a per-layer type list naming such a
    layer (``layer_types``, ``layers_block_type``: Qwen3.5's "linear_attention"; Gemma's sliding windows are not)."""
    found = RECURRENT_MODEL_TYPES.get(str(config.get("model_type")))
    if found:
        return found
    text = config.get("text_config")
    if isinstance(text, dict) and (found := recurrent_layers(text)):  # Qwen3.5's layer types, under its text config
        return found
    if any(isinstance(k, str) and ("mamba" in k.lower() or k.lower().startswith("ssm_")) for k in config):
        return "Mamba"
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds = config.get(key)
        for kind in kinds if isinstance(kinds, list) else []:
            for word, name in _RECURRENT_WORDS:
                if isinstance(kind, str) and word in kind.lower():
                    return name
    return None


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
        encoder_decoder = bool(config["is_encoder_decoder"])
    else:
        encoder_decoder = architecture_is_encoder_decoder(model_type) if "model_type" in config else False
    return ModelKind(model_type, encoder_decoder, recurrent_layers(config), attention_of(config))


def dir_is_encoder_decoder(path: str | Path) -> bool:
    """``is_encoder_decoder`` of a model directory (its config.json, else its architecture's default), or of
    an adapter directory (PEFT's task type); nothing is loaded."""
    return model_kind(path).encoder_decoder


def init_kind(init: dict[str, Any]) -> ModelKind:
    """The kind of a model built from scratch from ``{architecture: ..., <config fields>}``."""
    arch = init["architecture"]
    encoder_decoder = init["is_encoder_decoder"] if "is_encoder_decoder" in init else architecture_is_encoder_decoder(arch)
    config = _built_config(str(arch), json.dumps(init, default=str))
    return ModelKind(str(arch), bool(encoder_decoder), recurrent_layers(config), attention_of(config))


def attention_of(config: dict[str, Any]) -> str | None:
    """``fixed_attention`` of a config.json's model: of its text model where it has one (an image-text model's
    language model is another model type, with its own attention layers)."""
    text = config.get("text_config")
    text_type = text.get("model_type") if isinstance(text, dict) else None
    return fixed_attention(str(text_type or config.get("model_type") or "") or None)


ATTENTION_INTERFACE = "ALL_ATTENTION_FUNCTIONS"  # where transformers' modeling code looks attention functions up


@lru_cache(maxsize=None)
def fixed_attention(model_type: str | None) -> str | None:
    """Why ``model_type``'s attention layers cannot run an attention function registered by name (trainforge's
    document kernels, which keep packed documents apart), or None where they can or nothing is known. Read from
    transformers' modeling source of the type, without importing it: layers that take a registered function look it
    up in ``ALL_ATTENTION_FUNCTIONS``; Falcon, Bloom, GPT-Neo, MPT, ... compute attention their own way."""
    if not model_type:
        return None
    import importlib.util

    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        spec = importlib.util.find_spec(f"transformers.models.{model_type_to_module_name(model_type)}")
    except (ImportError, ValueError):
        return None
    sources = [f for d in (spec.submodule_search_locations or []) for f in Path(d).glob("modeling_*.py")] if spec else []
    if not sources or any(ATTENTION_INTERFACE in f.read_text(errors="replace") for f in sources):
        return None
    return (f"transformers' {model_type} layers compute attention their own way (not through its attention "
            "interface, where trainforge's document kernels plug in)")


def built_config(init: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields a model built from ``model.init`` gets (the class's defaults filled in)."""
    return dict(_built_config(str(init["architecture"]), json.dumps(init, default=str)))


@lru_cache(maxsize=64)
def _built_config(arch: str, init_json: str) -> dict[str, Any]:
    """The config.json a model built from ``model.init`` gets: the config class fills in fields the user leaves out
    (Qwen3.5's ``layer_types``); the given fields alone where the class refuses them (its validator says why)."""
    init = {k: v for k, v in json.loads(init_json).items() if k != "architecture"}
    try:
        from transformers import CONFIG_MAPPING

        return {**CONFIG_MAPPING[arch](**init).to_dict(), "model_type": arch}
    except Exception:  # an unknown architecture or a bad field: reported by the model section's validation
        return {**init, "model_type": arch}


@lru_cache(maxsize=None)
def architecture_is_encoder_decoder(arch: str) -> bool:
    """The default ``is_encoder_decoder`` of a transformers architecture (False for one transformers lacks)."""
    from transformers import CONFIG_MAPPING  # lazy: importing transformers costs seconds

    if arch not in CONFIG_MAPPING:
        return False
    cls = CONFIG_MAPPING[arch]
    try:
        return bool(getattr(cls(), "is_encoder_decoder", False))
    except Exception:  # a class whose own defaults fail its validation (Gemma 4's drafters): its class-level default
        return bool(getattr(cls, "is_encoder_decoder", False))


@lru_cache(maxsize=None)
def has_sdpa(model_type: str | None) -> bool:
    """Whether transformers' sequence-to-sequence class of ``model_type`` runs torch's SDPA attention (Switch
    Transformers, LongT5, LED, NLLB-MoE, ... have eager attention only); True where the class is not known."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(str(model_type), ""), None)
    return cls is None or bool(getattr(cls, "_supports_sdpa", True))


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


class UnsupportedModelDir(TrainforgeError, ValueError):
    """A model, tokenizer or adapter directory trainforge will not load: it needs code transformers does not ship."""


class CustomCodeError(UnsupportedModelDir):
    """The directory's ``auto_map`` names Python code of its own (``configuration_*.py``, ``modeling_*.py``, ...)."""


SHIPPED_ONLY = "trainforge loads only architectures that transformers ships"


def refuse_custom_code(path: str | Path, role: str = "", _seen: frozenset[Path] = frozenset()) -> None:
    """Raise unless ``path`` loads with transformers' own classes alone (and its JSON files parse); nothing is imported from it, no prompt.

    Refused: a config.json whose ``auto_map`` is needed (its ``model_type`` is not one transformers ships),
    a config.json naming a ``model_type`` transformers does not know, a tokenizer_config.json whose ``auto_map``
    names a tokenizer class transformers does not ship, and an adapter (adapter_config.json) whose local base
    directory is refused. An ``auto_map`` beside a shipped ``model_type`` (hub snapshots of models transformers
    has since adopted) is ignored: loaders pass ``trust_remote_code=False``, and transformers uses its own class.
    ``role``: what the directory is to the user (``model.tokenizer``), put before its name in the message."""
    where = f"{role} {path}".strip()
    for name in (CONFIG, TOKENIZER_CONFIG, ADAPTER_CONFIG):
        problem = _json_problem(*_version(path, name))
        if problem:
            raise UnsupportedModelDir(f"{where}: its {name} {problem}; fix or replace the file (a saved model writes it)")
    config = _read_json(*_version(path, CONFIG))
    model_type = config.get("model_type")
    shipped = isinstance(model_type, str) and is_architecture(model_type)
    auto_map = config.get("auto_map")
    if auto_map and not shipped:
        raise CustomCodeError(f"{where} needs custom code ({CONFIG} auto_map: {_describe_auto_map(auto_map)}); {SHIPPED_ONLY}")
    if model_type is not None and not shipped:
        raise UnsupportedModelDir(
            f"{where}: {CONFIG} names model_type {model_type!r}, which transformers does not know; {SHIPPED_ONLY}"
        )
    tokenizer_config = _read_json(*_version(path, TOKENIZER_CONFIG))
    tokenizer_map = tokenizer_config.get("auto_map")
    if tokenizer_map and not _shipped_tokenizer_class(tokenizer_config.get("tokenizer_class")):
        raise CustomCodeError(
            f"{where} needs custom code ({TOKENIZER_CONFIG} auto_map: {_describe_auto_map(tokenizer_map)}); {SHIPPED_ONLY}"
        )
    if not config:
        adapter = _read_json(*_version(path, ADAPTER_CONFIG))
        base = adapter.get("base_model_name_or_path")
        seen = _seen | {Path(path).resolve()}
        if isinstance(base, str) and base and Path(base).is_dir() and Path(base).resolve() not in seen:
            try:
                refuse_custom_code(base, _seen=seen)
            except UnsupportedModelDir as e:
                raise type(e)(f"the adapter in {where} adapts {base}: {e}") from None


class AdapterNotModel(TrainforgeError, ValueError):
    """A PEFT adapter directory given where training needs a model to start from."""


def refuse_adapter(path: str | Path, role: str = "model.path") -> None:
    """Raise when ``path`` is a PEFT adapter (adapter_config.json, no config.json), such as a LoRA run's final/:
    a run trains a model, which the adapter must first be merged into."""
    path = Path(path)
    if has_any(path, (ADAPTER_CONFIG,)) and not has_any(path, (CONFIG,)):
        raise AdapterNotModel(
            f"{role}: {path} is a PEFT adapter ({ADAPTER_CONFIG}, no {CONFIG}), not a model to train from; merge it "
            f"into its base first, `trainforge export {path} --merge --out DIR`, and set {role}: DIR"
        )


def _describe_auto_map(auto_map: Any) -> str:
    """``AutoConfig=configuration_evil.EvilConfig, ...``: what an ``auto_map`` points at, short."""
    if isinstance(auto_map, dict):
        parts = [f"{k}={v if not isinstance(v, (list, tuple)) else ', '.join(map(str, filter(None, v)))}" for k, v in auto_map.items()]
    elif isinstance(auto_map, (list, tuple)):
        parts = [str(v) for v in auto_map if v]
    else:
        parts = [str(auto_map)]
    text = "; ".join(parts)
    return text if len(text) <= 200 else text[:197] + "..."


def _shipped_tokenizer_class(name: Any) -> bool:
    """Whether transformers has a tokenizer class of this name (``Fast`` suffix or not)."""
    if not isinstance(name, str) or not name:
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return any(
            (cls := tokenizer_class_from_name(n)) is not None and cls.__module__.startswith("transformers.")
            for n in (name, name.removesuffix("Fast"), name + "Fast")
        )
    except Exception:  # an odd name transformers chokes on is no class of it
        return False


def _version(path: str | Path | None, name: str) -> tuple[str, tuple[int, int, int] | None]:
    """A file of a directory, resolved, and what tells its versions apart (None: no such regular file)."""
    try:
        file = (Path(path) / name).resolve()
        st = file.stat()
    except (OSError, TypeError, RuntimeError):
        return str(path), None
    return str(file), ((st.st_mtime_ns, st.st_size, st.st_ino) if stat.S_ISREG(st.st_mode) else None)


@lru_cache(maxsize=256)
def _json_problem(file: str, version: tuple[int, int, int] | None) -> str | None:
    """What is wrong with a JSON object file that exists (None: nothing, or no such file), per version."""
    if version is None:
        return None
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        return f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    except RecursionError:
        return "is JSON nested too deeply to parse"
    return None if isinstance(data, dict) else f"holds a JSON {type(data).__name__}, not an object"


@lru_cache(maxsize=256)
def _read_json(file: str, version: tuple[int, int, int] | None) -> dict[str, Any]:
    """A JSON object file, cached per version; callers get it shared, to read (``read_config`` hands out copies)."""
    if version is None:
        return {}
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError, RecursionError):  # _json_problem says what is wrong, where it matters
        return {}
    return data if isinstance(data, dict) else {}


def readable_like_config(folder: Path) -> None:
    """Give a saved model's files the permissions of the directory's JSON files. transformers 5 writes
    ``*.safetensors`` through a private temporary file (mode 0600), so on a shared machine nobody else could
    read the weights beside a world-readable config.json; the JSON files were written under the user's umask."""
    reference = next((folder / name for name in (CONFIG, ADAPTER_CONFIG) if (folder / name).is_file()), None)
    if reference is None:
        return
    mode = stat.S_IMODE(reference.stat().st_mode)
    for path in folder.iterdir():
        if path.is_file() and path.suffix == ".safetensors" and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)
