"""``trainforge export --format gguf``: one GGUF file for llama.cpp, Ollama and LM Studio.

The model is taken at full precision first: a full model in fp32, a LoRA/DoRA adapter merged into its base
in fp32, a QLoRA adapter merged into its NF4 base dequantized once to fp32 (what it trained against, never
the 4-bit values themselves). Then each weight is stored f16 (default), bf16 or q8_0 (gguf-py's quantizers;
vectors stay f32), with the hyperparameters, the tokenizer and the run's chat template as metadata.

Everything that can be refused is refused before the weights load: an unknown --quant, an existing --out or
Modelfile, a run without final/, a family or tokenizer llama.cpp would read differently. The file is written
under a temporary name beside --out and published whole (``atomic.publish_new_file``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..metrics.console import ConsoleReporter
from ..model.resolve import ModelSource, resolve_source
from ..rundir.atomic import atomic_write_text, publish_new_file
from .export_ollama import ollama_files
from .gguf_model import (
    QUANTS,
    Family,
    GGUFExportError,
    encode,
    family_of,
    file_type,
    gguf_tensors,
    write_hparams,
)
from .gguf_vocab import Vocab, read_vocab, write_vocab

MODELFILE = "Modelfile"


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFExportError("GGUF export needs the gguf package: pip install 'trainforge[gguf]'") from None


def check_out(out: Path, quant: str, ollama: Path | None) -> None:
    """The options, refused with what to do before anything is read or written."""
    if quant not in QUANTS:
        raise GGUFExportError(f"--quant {quant!r}: use one of {', '.join(QUANTS)}")
    if out.exists() or out.is_symlink():
        raise GGUFExportError(f"--out {out} already exists; choose a new file name (nothing was overwritten)")
    if out.suffix != ".gguf":
        raise GGUFExportError(f"--out {out}: name the file NAME.gguf (llama.cpp and Ollama look for the .gguf suffix)")
    if ollama is not None and (ollama / MODELFILE).exists():
        raise GGUFExportError(f"--ollama {ollama} already holds a {MODELFILE}; choose another directory or remove it")
    if ollama is not None and ollama.exists() and not ollama.is_dir():
        raise GGUFExportError(f"--ollama {ollama} is a file; give a directory for the Modelfile")


def _model_config(src: ModelSource) -> tuple[dict[str, Any], Path]:
    path = (src.base or src.weights) / "config.json"
    return json.loads(path.read_text()), path


def run_chat_template(src: ModelSource, tokenizer) -> str | None:
    """The chat template the run trained with: saved with final/'s tokenizer, else the run's data.chat_template."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one is what apply_chat_template uses
        template = template.get("default")
    configured = (src.run_config or {}).get("data", {}).get("chat_template")
    return template or (configured if isinstance(configured, str) and "{" in configured else None)


def _renderer(tokenizer, template: str):
    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    return render


def _end_of_turn_id(tokenizer, end_text: str) -> int | None:
    """The end-of-turn token llama.cpp's chat mode stops at: the text closing an assistant turn, when it is
    one special token other than EOS (ChatML's <|im_end|>, Llama 3's <|eot_id|>)."""
    if not end_text:
        return None
    ids = tokenizer(end_text, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return ids[0] if len(ids) == 1 and ids[0] in special and ids[0] != tokenizer.eos_token_id else None


def export_gguf(source: str | Path, out: Path, quant: str, ollama: Path | None, reporter: ConsoleReporter) -> dict[str, Any]:
    """Write the model ``source`` names as one GGUF file ``out`` (and a Modelfile in ``ollama``)."""
    from transformers.utils import logging as hf_logging

    from .export_ollama import chat_shape
    from .merge import full_model

    hf_logging.disable_progress_bar()
    out = Path(out)
    ollama = Path(ollama) if ollama is not None else None
    check_out(out, quant, ollama)
    _require_gguf()
    src = resolve_source(source)
    config, config_path = _model_config(src)
    family = family_of(config, str(config_path))
    from ..model.resolve import load_source_tokenizer

    tokenizer = load_source_tokenizer(src)
    read_vocab(tokenizer, max(int(config.get("vocab_size") or 0), len(tokenizer)))  # refused here, before the weights load
    template = run_chat_template(src, tokenizer)
    shape = chat_shape(_renderer(tokenizer, template), tokenizer.bos_token) if template else None
    reporter.info(f"model: {src.describe()}; writing GGUF ({family.arch_name}, {quant})")

    model, tokenizer = full_model(src, reporter)
    vocab = read_vocab(tokenizer, model.get_input_embeddings().num_embeddings)
    for warning in vocab.warnings:
        reporter.warn(warning)
    end_id = _end_of_turn_id(tokenizer, shape.end_of_turn) if shape else None
    # general.name stays the file's: transformers' reader turns a file named exactly "mistral" into an architecture
    # gguf-py has no tensor map for; as llama.cpp's llama architecture it reads back as LlamaForCausalLM, the same model
    name = out.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        publish_new_file(out, lambda tmp: _write(tmp, model, family, vocab, quant, template, end_id, name))
    except FileExistsError:
        raise GGUFExportError(f"--out {out} appeared while exporting; the export was not published, choose a new file name") from None
    reporter.info(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    result: dict[str, Any] = {"out": str(out), "quant": quant, "arch": family.arch_name, "chat_template": template is not None}
    if ollama is not None:
        text, warnings = ollama_files(out, ollama, _renderer(tokenizer, template) if template else None,
                                      tokenizer.bos_token, vocab.add_bos)
        ollama.mkdir(parents=True, exist_ok=True)
        atomic_write_text(ollama / MODELFILE, text)
        for warning in warnings:
            reporter.warn(warning)
        reporter.info(f"wrote {ollama / MODELFILE}: `ollama create NAME -f {ollama / MODELFILE}`")
        result["modelfile"] = str(ollama / MODELFILE)
    return result


def _write(path: Path, model, family: Family, vocab: Vocab, quant: str, template: str | None, end_id: int | None,
           name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, family.arch_name)
    writer.add_name(name)
    write_hparams(writer, model.config, family, len(vocab.tokens))
    writer.add_file_type(file_type(quant))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(writer, vocab, template, end_id)
    raw = (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0)  # bytes whose tensor shape the writer derives
    for tensor_name, data in gguf_tensors(model, family):
        stored, ggml_type = encode(data, quant)
        writer.add_tensor(tensor_name, stored, raw_dtype=ggml_type if ggml_type in raw else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
