"""A Hugging Face fast tokenizer as GGUF tokenizer metadata.

Two shapes, the two llama.cpp tokenizes with:

- **byte-level BPE** (GPT-2 style: trainforge's trained BPE, Llama 3, Qwen2/3): ``tokenizer.ggml.model =
  gpt2``, the vocabulary in id order, the merges, and the pre-tokenizer's name (``gpt-2`` for ByteLevel's own
  regex; for a Split regex the name llama.cpp and transformers' GGUF reader give that exact regex);
- **SentencePiece-style BPE** (``▁`` for spaces, byte fallback: Llama 2, Mistral, Phi-3): ``llama``, the
  vocabulary with scores (earlier ids merge first) and types, and the merges for readers that take them.

Token types: special added tokens are CONTROL, other added tokens USER_DEFINED, ``<0xNN>`` pieces BYTE,
ids past the tokenizer's end (an embedding padded beyond the vocabulary) UNUSED placeholders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .gguf_model import GGUFExportError

BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class Vocab:
    """What ``write_vocab`` stores."""

    model: str  # gpt2 or llama
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None


def _merges(model: dict[str, Any]) -> list[str]:
    """The BPE merges as "a b" strings (tokenizers writes pairs as lists since 0.20, as strings before)."""
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _split_regex(pre: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(the Split pattern before a regex-less ByteLevel, or None; whether ByteLevel applies its own regex)."""
    if pre is None:
        return None, False
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    pattern, own_regex, byte_level = None, False, False
    for step in steps:
        if step.get("type") == "Split":
            pattern = (step.get("pattern") or {}).get("Regex")
        elif step.get("type") == "ByteLevel":
            byte_level = True
            own_regex = bool(step.get("use_regex", True))
    return (pattern if byte_level else None), own_regex


def _pre_name(pattern: str | None, own_regex: bool) -> str | None:
    """llama.cpp's name of this pre-tokenization (its names, as transformers' GGUF reader maps them to regexes)."""
    if pattern is None:
        return "gpt-2" if own_regex else None
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS,
    )

    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        if regex == pattern:
            return name
    return None


def _is_byte_level(backend: dict[str, Any]) -> bool:
    pre, decoder = backend.get("pre_tokenizer") or {}, backend.get("decoder") or {}
    return "ByteLevel" in json.dumps(pre) or decoder.get("type") == "ByteLevel"


def _is_sentencepiece(backend: dict[str, Any]) -> bool:
    text = json.dumps([backend.get("pre_tokenizer"), backend.get("normalizer"), backend.get("decoder")])
    return "\\u2581" in text or "\u2581" in text


def read_vocab(tokenizer, vocab_size: int) -> Vocab:
    """The tokenizer's GGUF description, padded to the model's ``vocab_size`` embedding rows; refused (with
    what to do) when llama.cpp would tokenize it differently."""
    if not getattr(tokenizer, "is_fast", False):
        raise GGUFExportError("the tokenizer has no tokenizer.json (a slow tokenizer); save it as a fast tokenizer first")
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"the tokenizer is a {model.get('type')} model; GGUF export handles BPE tokenizers "
                              "(byte-level or SentencePiece-style); export a Hugging Face directory (--format hf)")
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size:
        raise GGUFExportError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} embeddings")
    by_id = {i: t for t, i in vocab.items()}
    added = {i: a for i, a in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    tokens, types = _tokens_and_types(by_id, added, vocab_size)
    if _is_byte_level(backend):
        pattern, own_regex = _split_regex(backend.get("pre_tokenizer"))
        pre = _pre_name(pattern, own_regex)
        if pre is None:
            raise GGUFExportError(
                "the tokenizer's pre-tokenizer splits text with a pattern llama.cpp has no name for "
                f"({pattern!r}); llama.cpp would split text differently. Export a Hugging Face directory (--format hf)"
            )
        out = Vocab("gpt2", pre, tokens, types, _merges(model))
    elif _is_sentencepiece(backend):
        scores = [-float(i) for i in range(vocab_size)]  # llama.cpp's SentencePiece merges higher scores first
        for i, kind in enumerate(types):
            if kind != 1:  # normal pieces only: control/added/byte pieces take no part in merging
                scores[i] = 0.0 if kind == 6 else -1000.0
        out = Vocab("llama", "default", tokens, types, _merges(model), scores=scores,
                    add_space_prefix=_prepends_space(backend))
    else:
        raise GGUFExportError("the tokenizer is neither byte-level nor SentencePiece-style BPE; export a Hugging Face "
                              "directory (--format hf)")
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            out.special_ids[name] = int(token_id)
    out.add_bos, out.add_eos = _adds_specials(tokenizer)
    return out


def _tokens_and_types(by_id: dict[int, str], added: dict[int, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    import gguf

    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")  # an embedding row no text encodes to: llama.cpp's placeholder
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if getattr(added[i], "special", False) else gguf.TokenType.USER_DEFINED)
        elif BYTE_PIECE.match(token):
            tokens.append(token)
            types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _prepends_space(backend: dict[str, Any]) -> bool:
    """Whether the tokenizer puts ``▁`` before the text (Metaspace's prepend scheme, or a Prepend normalizer)."""
    text = json.dumps([backend.get("pre_tokenizer"), backend.get("normalizer")])
    return '"Prepend"' in text or '"prepend_scheme": "first"' in text or '"prepend_scheme": "always"' in text


def _adds_specials(tokenizer) -> tuple[bool, bool]:
    """Whether encoding a text adds BOS in front / EOS behind (what llama.cpp's add_bos/add_eos say)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(full) > len(plain) and full[0] == bos
    add_eos = eos is not None and len(full) > len(plain) and full[-1] == eos
    return add_bos, add_eos


def write_vocab(writer, vocab: Vocab, chat_template: str | None, end_of_turn: int | None) -> None:
    """The tokenizer keys (through GGUFWriter's methods, so gguf.Keys names them)."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    ids = vocab.special_ids
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if name in ids:
            add(ids[name])
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if end_of_turn is not None:
        writer.add_eot_token_id(end_of_turn)  # llama.cpp's chat mode stops at it
    if chat_template:
        writer.add_chat_template(chat_template)
