"""too_long: split under each packing mode: count that every token is an input and a target once.

A split document is stored as blocks of max_length + 1 tokens that overlap by one token (the
block's first token repeats the previous block's last). That overlap is deliberate for rows of
their own (packing true/false): the repeated token is a target at the end of one block and the
input that predicts the next token at the start of the other, so no target is lost at a cut.
A concat stream is continuous, so there the repeat is skipped: each token appears once.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conftest import WORDS, toy_documents, write_jsonl
from trainforge.config.data import DataSettings
from trainforge.data.formats import IGNORE
from trainforge.data.loader import RowCollator
from trainforge.data.packing import build_rows, row_tokens, weighted_indices
from trainforge.data.prepare import prepare_data
from trainforge.data.store import StoreWriter, TokenStore
from trainforge.model.tokenizer import load_tokenizer

MAX_LENGTH = 16


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tok):
    """(documents as token lists, in order; the store of the same data split at MAX_LENGTH)."""
    tmp = tmp_path_factory.mktemp("split")
    long_docs = [" ".join(WORDS[(k + i) % len(WORDS)] for i in range(n)) + "." for k, n in ((0, 60), (3, 45), (7, 33))]
    texts = toy_documents(6, seed=1)[:3] + long_docs[:2] + toy_documents(6, seed=1)[3:] + long_docs[2:]
    path = write_jsonl(tmp / "train.jsonl", [{"text": t} for t in texts])

    def prepare(max_length, too_long):
        cfg = DataSettings(train=str(path), eval=None, max_length=max_length, too_long=too_long, cache_dir=tmp / "cache", num_workers=1)
        return prepare_data(cfg, tok, seed=0, log=lambda *_: None)

    whole = prepare(4096, "truncate").train  # the reference: each document in one piece
    docs = [whole.sequence(i)[0].tolist() for i in range(len(whole))]
    split = prepare(MAX_LENGTH, "split")
    assert len(docs) == len(texts) and max(map(len, docs)) > 3 * (MAX_LENGTH + 1)
    assert split.stats["split"] == sum(len(d) > MAX_LENGTH + 1 for d in docs) < len(docs)  # some split, some whole
    assert split.stats["train_target_tokens"] == sum(len(d) - 1 for d in docs)
    return docs, split.train


def batches(store, packing):
    """(inputs, labels) of every row, in row order, without padding."""
    rows = build_rows(store, weighted_indices(store, [1.0], seed=0), packing, MAX_LENGTH)
    collate = RowCollator(store, 0, packing, MAX_LENGTH)
    out = []
    for row in rows:
        b = collate([row], [0])
        n = row_tokens(row, packing == "concat")
        assert n <= MAX_LENGTH and (b.labels[0, n:] == IGNORE).all()
        out.append((b.input_ids[0, :n].tolist(), b.labels[0, :n].tolist()))
    return out


def test_concat_split_is_the_corpus_stream_once(corpus):
    docs, store = corpus
    stream = [t for d in docs for t in d]
    got = batches(store, "concat")
    inputs = [t for inp, _ in got for t in inp]
    targets = [t for _, lab in got for t in lab if t != IGNORE]
    # every token is an input once (the last has nothing to predict), no repeat at a cut
    assert inputs == stream[:-1]
    # one stream across documents: every token after the first is a target once, in order
    assert targets == stream[1:]
    assert all(len(inp) == MAX_LENGTH for inp, _ in got[:-1])  # full blocks: nothing lost to padding


@pytest.mark.parametrize("packing", [True, False])
def test_rows_of_their_own_train_each_target_once(corpus, packing):
    docs, store = corpus
    got = batches(store, packing)
    pairs = Counter((x, y) for inp, lab in got for x, y in zip(inp, lab) if y != IGNORE)
    # each (context token, next token) of each document once: cuts lose no target, repeat none
    assert pairs == Counter(p for d in docs for p in zip(d[:-1], d[1:]))
    assert sum(pairs.values()) == sum(len(d) - 1 for d in docs)
    # every token of a document but its last is an input once: the token repeated at a cut is
    # the target that ends one block and the input that starts the next
    inputs = Counter(t for inp, _ in got for t in inp)
    assert inputs == Counter(t for d in docs for t in d[:-1])


def test_concat_skips_the_repeat_only_after_its_own_predecessor(tmp_path):
    w = StoreWriter(tmp_path / "s", 100)
    w.start_source()
    seqs, cont = [[1, 2, 3], [3, 4, 5], [9, 8]], [False, True, False]  # [3, 4, 5] continues [1, 2, 3]
    w.append(np.concatenate(seqs), np.ones(8, np.uint8), np.array([3, 3, 2]), np.array(cont))
    w.close({})
    store = TokenStore(tmp_path / "s")

    def stream(index):
        rows = build_rows(store, np.array(index), "concat", 100)
        return [t for r in rows for t in RowCollator(store, 0, "concat", 100)._row(r)[0]]

    assert stream([0, 1, 2]) == [1, 2, 3, 4, 5, 9]
    assert stream([1, 2]) == [3, 4, 5, 9]  # sampled without its predecessor: keeps its first token
    assert stream([0, 1, 0, 1]) == [1, 2, 3, 4, 5, 1, 2, 3, 4]  # a source weighted 2: each copy whole
