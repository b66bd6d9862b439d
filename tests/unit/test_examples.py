"""Rows named by their documents' source and first words (data/examples.py): what the non-finite stop and the
spike advice print, so a user can find the examples in the files."""

from __future__ import annotations

import numpy as np

from trainforge.data.examples import describe_rows
from trainforge.data.packing import packed_rows
from trainforge.data.store import StoreWriter, TokenStore
from trainforge.model.tokenizer import build_char_tokenizer

TEXTS = {"a.jsonl": ["alpha beta", "gamma"], "b.jsonl": ["delta epsilon zeta eta theta iota kappa lambda mu nu xi"]}


def store_of(tmp_path, tok) -> TokenStore:
    w = StoreWriter(tmp_path / "s", len(tok))
    for texts in TEXTS.values():
        w.start_source()
        for text in texts:
            ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
            w.append(ids, np.ones(len(ids), np.uint8), np.asarray([len(ids)]))
    w.close({})
    return TokenStore(tmp_path / "s")


def test_each_document_is_named_by_its_source_and_first_words(tmp_path):
    tok = build_char_tokenizer(t for texts in TEXTS.values() for t in texts)
    store = store_of(tmp_path, tok)
    rows = [np.array([[store.offsets[i], store.offsets[i + 1]] for i in (0, 1)]), np.array([[store.offsets[2], store.offsets[3]]])]
    text = describe_rows(store, rows, list(TEXTS), tok, [1, 0])
    assert text.startswith('row 1: b.jsonl "delta epsilon zeta eta theta iot..." (55 tokens) | row 0: a.jsonl "alpha beta" (10 tokens); ')
    assert text.endswith('a.jsonl "gamma" (5 tokens)')


def test_long_rows_and_many_rows_are_cut_and_counted(tmp_path):
    tok = build_char_tokenizer(t for texts in TEXTS.values() for t in texts)
    store = store_of(tmp_path, tok)
    rows = packed_rows(store, np.arange(3), 128)  # one row: all three documents
    assert len(rows) == 1 and describe_rows(store, rows, list(TEXTS), tok, [0]).endswith("; + 1 more document")
    text = describe_rows(store, rows * 6, list(TEXTS), tok, [0, 1, 2, 3, 4, 5, 99])
    assert text.count("row ") == 4 and text.endswith(" | + 3 more rows")
