"""SentencePiece-style BPE (``▁`` for spaces, byte fallback: Llama 2, Mistral v0.1-v0.3, Phi-3) as llama.cpp's
``llama`` tokenizer.

llama.cpp tokenizes such a vocabulary as SentencePiece does, not from a merge list: it splits the text into
characters and keeps joining the two neighbours whose concatenation is the vocabulary piece with the highest
score (the leftmost on a tie); a character outside the vocabulary becomes its UTF-8 byte pieces ``<0xNN>``.
Its converter writes no merges for it, and transformers' GGUF reader rebuilds the merges from the scores the
same way. So the scores carry the merge order: a piece's score is minus the rank of the first merge that
makes it, which reproduces the run's BPE exactly when its merges are every two-piece split of every merged
piece, grouped by piece (what transformers' converter writes from a SentencePiece model). A merge list of
another shape (a BPE trained with the tokenizers library) is written all the same, with a warning.

What llama.cpp cannot do at all is refused (``GGUFExportError``): no byte fallback, a normalizer other than
SentencePiece's ``▁`` prefix and space replacement, a pre-tokenizer that splits the text.
"""

from __future__ import annotations

import re
from typing import Any

from .gguf_model import GGUFExportError

SPACE = "\u2581"
BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
NORMAL = 1  # gguf.TokenType.NORMAL
ADVICE = "Export a Hugging Face directory (--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py"


def _steps(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if not node:
        return []
    return list(node.get(key) or []) if node.get("type") == "Sequence" else [node]


def check_spm(backend: dict[str, Any], vocab: dict[str, int]) -> list[str]:
    """Refuse (with what to do) a SentencePiece-style tokenizer llama.cpp cannot read alike; the warnings for
    one it reads alike except where the tokenizer splits the text at spaces."""
    model = backend.get("model") or {}
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if not model.get("byte_fallback") or missing:
        why = "model.byte_fallback is off" if not model.get("byte_fallback") else f"{len(missing)} of the 256 byte pieces are missing (e.g. {missing[0]})"
        raise GGUFExportError(
            f"the tokenizer is SentencePiece-style BPE without byte fallback ({why}); llama.cpp's SentencePiece "
            f"tokenizer spells every character outside the vocabulary as its <0x00>..<0xFF> byte pieces. {ADVICE}")
    for step in _steps(backend.get("normalizer"), "normalizers"):
        kind = step.get("type")
        replaces_space = kind == "Replace" and (step.get("pattern") or {}).get("String") == " " and step.get("content") == SPACE
        if not (replaces_space or (kind == "Prepend" and step.get("prepend") == SPACE)):
            raise GGUFExportError(
                f"the tokenizer's normalizer {kind} changes the text before BPE; llama.cpp's SentencePiece tokenizer only "
                f"writes spaces as {SPACE!r}, so it would tokenize differently. {ADVICE}")
    warnings = []
    for step in _steps(backend.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") != "Metaspace":
            raise GGUFExportError(
                f"the tokenizer's pre-tokenizer {step.get('type')} splits the text before BPE; llama.cpp's SentencePiece "
                f"tokenizer does not, so it would tokenize differently. {ADVICE}")
        spanning = sorted((piece for piece in vocab if SPACE in piece[1:]), key=vocab.__getitem__)  # by id: the same message every run
        if step.get("split", True) and spanning:
            warnings.append(f"the tokenizer's Metaspace pre-tokenizer splits the text at every space (split: true) and "
                            f"llama.cpp does not: pieces across a space ({spanning[0]!r} and {len(spanning) - 1} more) "
                            "are joined in llama.cpp, never by the run's tokenizer")
    return warnings


def merge_pairs(model: dict[str, Any]) -> list[tuple[str, str]]:
    """The BPE merges as pairs (tokenizers writes them as lists since 0.20, as "a b" strings before)."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in model.get("merges", [])]


def spm_scores(tokens: list[str], types: list[int], merges: list[tuple[str, str]]) -> tuple[list[float], int]:
    """(each token's score, how many two-piece splits llama.cpp could join that the run's merges do not).

    A piece made by merges scores minus the rank of its first merge; any other token scores below all of
    them (minus the merge count, minus its id), so llama.cpp never prefers it."""
    first_rank: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first_rank.setdefault(left + right, rank)
    scores = [-float(first_rank[t]) if kind == NORMAL and t in first_rank else -float(len(merges) + i)
              for i, (t, kind) in enumerate(zip(tokens, types))]
    return scores, _unmatched_splits(tokens, types, merges, first_rank)


def _unmatched_splits(tokens: list[str], types: list[int], merges: list[tuple[str, str]], first_rank: dict[str, int]) -> int:
    """The splits llama.cpp may join other than the run: a split of a normal piece into two normal pieces that
    is not a merge, or a merge ranked after another piece's merge though its piece's first merge came before."""
    normal = {t for t, kind in zip(tokens, types) if kind == NORMAL}
    pairs = set(merges)
    missing = sum(1 for t in normal for k in range(1, len(t))
                  if t[:k] in normal and t[k:] in normal and (t[:k], t[k:]) not in pairs)
    out_of_order, latest = 0, -1
    for rank, (left, right) in enumerate(merges):  # grouped by piece: each merge's piece first made at or after the previous
        first = first_rank[left + right]
        if first < latest:
            out_of_order += 1
        latest = max(latest, first)
    return missing + out_of_order


def _text(tokenizer, text: str) -> str:
    """The pieces ``text`` encodes to, joined, byte pieces as their characters (the special token kept whole)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    raw = bytearray()
    for piece in tokenizer.convert_ids_to_tokens(ids):
        byte = BYTE_PIECE.match(piece)
        raw += bytes([int(byte.group(1), 16)]) if byte else piece.encode("utf-8")
    return raw.decode("utf-8", errors="replace")


def space_prefix(tokenizer) -> tuple[bool, list[str]]:
    """(whether the tokenizer writes a ``▁`` before the text: GGUF's add_space_prefix; how llama.cpp's
    SentencePiece rule differs from it). llama.cpp, as SentencePiece, puts the ``▁`` before every text that
    follows a special token and before a text that already starts with a space; transformers' Llama tokenizer
    does neither with ``legacy=False`` and only the first with ``legacy=True``."""
    if not _text(tokenizer, "a").startswith(SPACE):
        return False, []
    differences = []
    special = tokenizer.bos_token or tokenizer.eos_token
    if special and not _text(tokenizer, f"{special}a").startswith(f"{special}{SPACE}"):
        differences.append(f"text right after a special token ({special}a: llama.cpp {special}{SPACE}a, the run {special}a, "
                           "as after a chat template's <s> or </s>)")
    if not _text(tokenizer, " a").startswith(SPACE * 2):
        differences.append(f"text that starts with a space (' a': llama.cpp {SPACE * 2}a, the run {SPACE}a)")
    return True, differences
