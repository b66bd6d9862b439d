"""A Hugging Face fast tokenizer as GGUF tokenizer metadata.

Two shapes, the two llama.cpp tokenizes with:

- **byte-level BPE** (GPT-2 style: trainforge's trained BPE, Llama 3, Qwen2/3): ``tokenizer.ggml.model =
  gpt2``, the vocabulary in id order, the merges, and the pre-tokenizer's name (``gpt-2`` for ByteLevel's own
  regex; for a Split regex the name llama.cpp and transformers' GGUF reader give that exact regex);
- **SentencePiece-style BPE** (``▁`` for spaces, byte fallback: Llama 2, Mistral v0.1-v0.3, Phi-3): ``llama``,
  the vocabulary with scores that carry the merge order and no merges, as llama.cpp's converter writes it
  (``gguf_spm``).

Token types: the unknown token UNKNOWN, other special added tokens CONTROL, other added tokens USER_DEFINED,
``<0xNN>`` pieces BYTE, ids past the tokenizer's end (an embedding padded beyond the vocabulary) UNUSED
placeholders. Any other tokenizer model (Unigram, WordPiece, WordLevel) is refused, naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .gguf_model import GGUFExportError
from .gguf_spm import (
    ADVICE,
    BYTE_PIECE,
    check_spm,
    merge_pairs,
    space_prefix,
    spm_scores,
)


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
    warnings: list[str] = field(default_factory=list)  # how llama.cpp will tokenize unlike the run


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
        raise GGUFExportError(f"the tokenizer is a {model.get('type')} model; GGUF export writes BPE tokenizers only "
                              f"(byte-level as GPT-2, or SentencePiece-style with byte fallback as Llama 2). {ADVICE}")
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_size:
        raise GGUFExportError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} embeddings")
    by_id = {i: t for t, i in vocab.items()}
    added = {i: a for i, a in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    byte_level = _is_byte_level(backend)
    unk = tokenizer.unk_token_id if not byte_level else None  # SentencePiece's unknown piece (llama.cpp's converter types it so)
    tokens, types = _tokens_and_types(by_id, added, vocab_size, unk)
    if byte_level:
        pattern, own_regex = _split_regex(backend.get("pre_tokenizer"))
        pre = _pre_name(pattern, own_regex)
        if pre is None:
            raise GGUFExportError(
                "the tokenizer's pre-tokenizer splits text with a pattern llama.cpp has no name for "
                f"({pattern!r}); llama.cpp would split text differently. Export a Hugging Face directory (--format hf)"
            )
        out = Vocab("gpt2", pre, tokens, types, _merges(model))
    elif _is_sentencepiece(backend):
        split_warnings = check_spm(backend, vocab)
        scores, unmatched = spm_scores(tokens, types, merge_pairs(model))
        prefix, differences = space_prefix(tokenizer)
        out = Vocab("llama", "default", tokens, types, [], scores=scores, add_space_prefix=prefix, warnings=split_warnings)
        if differences:
            out.warnings.append("llama.cpp's SentencePiece tokenizer will give other ids than the run's tokenizer for "
                                + " and for ".join(differences) + "; other text tokenizes alike")
        if unmatched:
            out.warnings.append(f"the tokenizer's merges are not SentencePiece's ({unmatched} two-piece splits of its pieces "
                                "are not merges, or merge out of order): llama.cpp joins pieces by score and may tokenize "
                                "some words differently; compare a few encodings with llama.cpp's llama-tokenize")
    else:
        raise GGUFExportError("the tokenizer is a BPE model but neither byte-level (GPT-2 style) nor SentencePiece-style "
                              f"(\u2581 for spaces); llama.cpp would split its text differently. {ADVICE}")
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            out.special_ids[name] = int(token_id)
    out.add_bos, out.add_eos = _adds_specials(tokenizer)
    return out


def _tokens_and_types(by_id: dict[int, str], added: dict[int, Any], vocab_size: int,
                      unk_id: int | None) -> tuple[list[str], list[int]]:
    import gguf

    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")  # an embedding row no text encodes to: llama.cpp's placeholder
            types.append(gguf.TokenType.UNUSED)
        elif i == unk_id:  # llama.cpp matches it whole in text, as a special token, and never merges into it
            tokens.append(token)
            types.append(gguf.TokenType.UNKNOWN)
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
