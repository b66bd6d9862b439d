"""``trainforge export``: a model directory ready to load elsewhere or upload.

``--merge``: a LoRA / DoRA adapter folded into its base, written as a plain Hugging Face
directory (safetensors, config, generation config, tokenizer) that
``AutoModelForCausalLM.from_pretrained`` (an encoder-decoder such as T5 or BART:
``AutoModelForSeq2SeqLM``, chosen from the config's ``is_encoder_decoder``) loads without PEFT. The base is loaded in fp32, the
adapter applied and merged (``merge_and_unload``: W + scale * B @ A, DoRA's magnitude included),
and the result cast to ``--dtype`` (default: the dtype the base was stored in).

QLoRA: the adapters were trained against the 4-bit NF4 base, not the original weights, so the
base is loaded in NF4 exactly as the run trained it and *dequantized* to fp32 before merging.
The merged model computes what the QLoRA model computed (up to rounding), at full size; merging
into the original unquantized weights instead would shift every layer by its quantization error.

A full model (a full fine-tune or from scratch) has nothing to merge: ``--merge`` re-saves it as the
same plain directory, so one command exports any run.

Without ``--merge``: the run's ``final/`` (or the given directory) is copied as it is, an adapter
or a full model, with the tokenizer beside it; ``--dtype`` re-saves a full model in that dtype.

The output is written to a temporary directory beside ``--out`` and renamed when complete.

``--format gguf``: one GGUF file for llama.cpp and Ollama (``export_gguf``), merged as above.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..rundir.atomic import atomic_write_dir
from ..hf_dir import readable_like_config
from ..metrics.console import ConsoleReporter
from ..model.load import auto_model_class
from ..model.resolve import ModelSource, ModelSourceError, load_source_tokenizer, resolve_source
from .merge import merged_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_SHARD_SIZE = "5GB"  # the hub's usual shard size: uploads and partial downloads stay manageable


def export_any(source: str | Path, out: Path, merge: bool, dtype: str | None, format_: str, quant: str | None,
               ollama: Path | None, reporter: ConsoleReporter) -> dict[str, Any]:
    """``trainforge export``: a Hugging Face directory (``export``) or a GGUF file (``export_gguf.export_gguf``)."""
    if format_ not in ("hf", "gguf"):
        raise ModelSourceError(f"--format {format_!r}: use hf (a Hugging Face directory) or gguf (one GGUF file)")
    if format_ == "gguf":
        if dtype is not None:
            raise ModelSourceError("--dtype applies to --format hf; a GGUF file's precision is --quant (f16, bf16 or q8_0)")
        from .export_gguf import export_gguf

        return export_gguf(source, out, quant or "f16", ollama, reporter)
    if quant is not None or ollama is not None:
        raise ModelSourceError("--quant and --ollama apply to --format gguf; add --format gguf")
    return export(source, out, merge, dtype, reporter)


def export(source: str | Path, out: Path, merge: bool, dtype: str | None, reporter: ConsoleReporter) -> dict[str, Any]:
    """Export the model ``source`` names into ``out``; returns what was written."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src = resolve_source(source)
    out = Path(out)
    if out.is_symlink() and not out.exists():  # renaming the finished export onto it would fail at the end
        raise ModelSourceError(
            f"--out {out} is a symbolic link to a missing path ({os.readlink(out)}): remove the link, or give another --out"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelSourceError(f"--out {out} already exists and is not an empty directory; choose a new path")
    if dtype is not None and dtype not in DTYPES:
        raise ModelSourceError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if not merge and dtype is not None and src.adapter is not None:
        raise ModelSourceError("--dtype applies to a merged or full model; an adapter is copied as trained (add --merge)")
    reporter.info(f"model: {src.describe()}")
    if merge and src.adapter is not None:
        kind, written = "merged", _write_atomically(out, lambda tmp: merge_adapter(src, tmp, dtype, reporter))
    elif merge or dtype is not None:
        if merge:
            reporter.info("a full model: nothing to merge; writing it as a plain Hugging Face directory")
        target = DTYPES[dtype] if dtype else _stored_dtype(src.weights)
        kind, written = "full", _write_atomically(out, lambda tmp: _resave(src, tmp, target))
    else:
        kind, written = ("adapter" if src.adapter else "full"), _write_atomically(out, lambda tmp: _copy(src, tmp))
    files = sorted(p.name for p in out.iterdir())
    reporter.info(f"exported {kind} model to {out}: {', '.join(files)}")
    if kind == "adapter":
        reporter.info(f"its adapter_config.json names the base {src.adapter.get('base_model_name_or_path')}; set it to the base's hub id before uploading")
    return {"out": str(out), "kind": kind, "dtype": written, "files": files}


def merge_adapter(src: ModelSource, out: Path, dtype: str | None, reporter: ConsoleReporter) -> str:
    """Base (dequantized for QLoRA) + adapter, merged, cast and saved in ``out``; returns the dtype name."""
    target = DTYPES[dtype] if dtype else _stored_dtype(src.base)
    merged, tokenizer = merged_model(src, reporter)
    return _save_plain(merged, tokenizer, out, target)


def _save_plain(model: torch.nn.Module, tokenizer, out: Path, dtype: torch.dtype) -> str:
    """Weights in ``dtype`` as safetensors shards, config, generation config and tokenizer."""
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    if not (out / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(model.config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    readable_like_config(out)
    return _dtype_name(dtype)


def _stored_dtype(model_dir: Path) -> torch.dtype:
    """The dtype a model directory's config says its weights are stored in (fp32 when unknown)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name), torch.float32) if str(name) in ("float32", "bfloat16", "float16") else torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _resave(src: ModelSource, out: Path, dtype: torch.dtype) -> str:
    """A full model re-saved in ``dtype`` with its tokenizer."""
    model = auto_model_class(src.encoder_decoder, src.model_type).from_pretrained(str(src.weights), dtype=dtype, trust_remote_code=False)
    return _save_plain(model, load_source_tokenizer(src), out, dtype)


def _copy(src: ModelSource, out: Path) -> str | None:
    """The model directory's files as they are, plus the tokenizer when it lives elsewhere."""
    for item in src.weights.iterdir():
        if item.is_file():
            shutil.copy2(item, out / item.name)
        elif item.is_dir():
            shutil.copytree(item, out / item.name)
    if src.tokenizer_dir != src.weights:
        load_source_tokenizer(src).save_pretrained(out)
    return None


def _write_atomically(out: Path, write: Callable[[Path], Any]) -> Any:
    """``write(tmp)`` into a temporary directory beside ``out``, renamed to ``out`` when complete
    (``atomic.atomic_write_dir``): an interrupted export leaves no half-written model under the name."""
    result: list[Any] = []
    atomic_write_dir(out, lambda tmp: result.append(write(tmp)))
    return result[0]
