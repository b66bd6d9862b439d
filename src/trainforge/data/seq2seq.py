"""Encoder-decoder examples: source -> target pairs as stored sequences, and their padded batches.

A pair is stored as one sequence of the token store, the source's tokens then the target's,
with the target's tokens marked learned and the source's not: the store, its cache and its
statistics stay those of decoder-only data, and the split point is the first learned token.

Tokens: the source as the tokenizer encodes inputs (T5 appends ``</s>``, BART wraps in
``<s> ... </s>``; a chat source carries its template's special tokens), the target as the
tokenizer encodes targets; each ends with EOS (appended when the tokenizer adds none). The
decoder learns every target token and nothing else. Truncation keeps the first tokens and the
final EOS, as Hugging Face tokenizers truncate (``truncation=True``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .formats import IGNORE, Pair, TokenizedChunk, encoder_for
from .loader import Batch, padded_width
from .store import TokenStore


def _encode(tokenizer, texts: list[str], special_tokens: bool) -> list[np.ndarray]:
    return [np.asarray(e.ids, dtype=np.int64) for e in encoder_for(tokenizer, special_tokens)(texts, offsets=False)] if texts else []


def _with_eos(ids: np.ndarray, eos: int) -> np.ndarray:
    return ids if len(ids) and ids[-1] == eos else np.append(ids, eos)


def _fit(ids: np.ndarray, limit: int) -> np.ndarray:
    """The first ``limit - 1`` tokens and the final one (EOS): how HF tokenizers truncate."""
    return ids if len(ids) <= limit else np.append(ids[: limit - 1], ids[-1])


def source_tokens(tokenizer, text: str, templated: bool = False, max_length: int | None = None) -> list[int]:
    """One source's tokens as ``tokenize_pairs`` stores them: encoded with the tokenizer's special tokens
    (a chat template's render, ``templated``: without, it writes its own), ending with EOS, and cut at
    ``max_length`` keeping that EOS. What the encoder reads at generation time is what it trained on."""
    ids = _with_eos(_encode(tokenizer, [text], not templated)[0], tokenizer.eos_token_id)
    return (_fit(ids, max_length) if max_length else ids).tolist()


def tokenize_pairs(
    pairs: Sequence[Pair], tokenizer, max_source: int, max_target: int, too_long: str
) -> TokenizedChunk:
    """Source and target tokens of each pair, back to back, the target's learned; too-long policy
    per side (``truncate`` or ``drop``), counted per side."""
    eos = tokenizer.eos_token_id
    chunk = TokenizedChunk(np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.int64))
    kept = [p for p in pairs if p.target is not None]
    chunk.dropped_masked = len(pairs) - len(kept)  # nothing to learn (a chat without an assistant turn)
    plain = [i for i, p in enumerate(kept) if not p.templated]
    templated = [i for i, p in enumerate(kept) if p.templated]
    sources: list[np.ndarray] = [np.empty(0, np.int64)] * len(kept)
    for idx, special in ((plain, True), (templated, False)):  # a chat template writes its own special tokens
        for i, ids in zip(idx, _encode(tokenizer, [kept[i].source for i in idx], special)):
            sources[i] = ids
    targets = _encode(tokenizer, [p.target for p in kept], True)
    out_ids, out_learn, lengths = [], [], []
    for src, tgt in zip(sources, targets):
        src, tgt = _with_eos(src, eos), _with_eos(tgt, eos)
        long_src, long_tgt = len(src) > max_source, len(tgt) > max_target
        if too_long == "drop" and (long_src or long_tgt):
            chunk.dropped_too_long += long_src
            chunk.target_dropped_too_long += long_tgt
            chunk.lost_tokens += len(src) + len(tgt)
            continue
        chunk.truncated += long_src
        chunk.target_truncated += long_tgt
        chunk.lost_tokens += max(0, len(src) - max_source) + max(0, len(tgt) - max_target)
        src, tgt = _fit(src, max_source), _fit(tgt, max_target)
        out_ids.append(np.concatenate([src, tgt]))
        out_learn.append(np.concatenate([np.zeros(len(src), np.uint8), np.ones(len(tgt), np.uint8)]))
        lengths.append(len(src) + len(tgt))
    if out_ids:
        chunk.ids = np.concatenate(out_ids)
        chunk.learn = np.concatenate(out_learn)
        chunk.lengths = np.asarray(lengths, dtype=np.int64)
        chunk.continues = np.zeros(len(lengths), dtype=bool)
    return chunk


class Seq2SeqCollator:
    """Rows of one source -> target example each -> encoder inputs, decoder inputs and labels.

    Source and target are right-padded, each to a multiple of ``PAD_MULTIPLE``. Labels are the
    target's tokens (IGNORE on padding); the decoder's inputs are the labels shifted right behind
    ``decoder_start_token_id`` (what the model's own ``prepare_decoder_input_ids_from_labels`` does),
    padding with ``pad_id``. The decoder is causal and its padding comes last, so it needs no mask.
    """

    packed = concat = False  # the loader's view: one example per row, grouped by length

    def __init__(self, store: TokenStore, pad_id: int, decoder_start_token_id: int, max_length: int, pin: bool = False):
        self.store, self.pad_id, self.start_id, self.max_length, self.pin = store, pad_id, decoder_start_token_id, max_length, pin

    def _split(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        (s, e), = row  # one stored sequence per row
        ids = np.asarray(self.store.ids[s:e], dtype=np.int64)
        cut = int(np.argmax(np.asarray(self.store.learn[s:e])))  # the first target token
        return ids[:cut], ids[cut:]

    def padding(self, rows: Sequence[np.ndarray]) -> tuple[int, int]:
        """(real tokens, tensor positions) of a batch of these rows, source and target together."""
        parts = [self._split(r) for r in rows]
        real = sum(len(a) + len(b) for a, b in parts)
        return real, len(rows) * (padded_width(max(len(a) for a, _ in parts)) + padded_width(max(len(b) for _, b in parts)))

    def __call__(self, rows: Sequence[np.ndarray], indices: list[int]) -> Batch:
        parts = [self._split(r) for r in rows]
        width_s, width_t = padded_width(max(len(a) for a, _ in parts)), padded_width(max(len(b) for _, b in parts))
        ids = np.full((len(rows), width_s), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width_s), dtype=np.int64)
        labels = np.full((len(rows), width_t), IGNORE, dtype=np.int64)
        dec = np.full((len(rows), width_t), self.pad_id, dtype=np.int64)
        for i, (src, tgt) in enumerate(parts):
            ids[i, : len(src)], mask[i, : len(src)] = src, 1
            labels[i, : len(tgt)] = tgt
            dec[i, 0], dec[i, 1 : len(tgt)] = self.start_id, tgt[:-1]
        batch = Batch(
            torch.from_numpy(ids),
            torch.from_numpy(labels),
            None,
            n_tokens=int(sum(len(a) + len(b) for a, b in parts)),  # the encoder's and the decoder's real tokens
            n_targets=int(sum(len(b) for _, b in parts)),
            indices=list(indices),
            attention_mask=torch.from_numpy(mask),
            decoder_input_ids=torch.from_numpy(dec),
        )
        return batch.pinned() if self.pin else batch
