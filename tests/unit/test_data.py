"""Data: sources, formats and loss masks, the token cache, packing, batching, bad input."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from conftest import make_store, write_jsonl
from trainforge.config.data import DataSettings, FieldNames
from trainforge.data.formats import IGNORE, Renderer, tokenize_rendered
from trainforge.data.loader import RowCollator, TrainLoader
from trainforge.data.packing import best_fit_decreasing, build_rows, concat_rows, weighted_indices
from trainforge.data.prepare import prepare_data
from trainforge.data.sources import BadRows, DataError, Row, iter_source
from trainforge.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def quiet(*_):
    pass


def prepare(tmp_path, tok, **data):
    cfg = DataSettings(cache_dir=tmp_path / "cache", num_workers=1, **data)
    return prepare_data(cfg, tok, seed=0, log=quiet)


# ---------------------------------------------------------------- formats and masks


def learned_targets(tok, rendered, max_length=256):
    chunk = tokenize_rendered([rendered], tok, max_length, "truncate", special_tokens=rendered.spans is None or True)
    ids, learn = chunk.ids, chunk.learn.astype(bool)
    return ids, [int(t) for t, m in zip(ids[1:], learn[1:]) if m]


def test_plain_text_is_tokenized_without_offsets_into_the_same_ids(tok, monkeypatch):
    """Text rows have no spans to place: the batch encoder skips the offsets (``encode_batch_fast``) and stores
    exactly the ids the tokenizer gives each document, special tokens and EOS as before; rows with spans keep
    their offsets. Every call is recorded to see which path ran."""
    from trainforge.data.formats import Rendered, encoder_for

    encoder = encoder_for(tok, True)
    assert encoder.backend is not None and hasattr(encoder.backend, "encode_batch_fast")
    calls: list[str] = []
    backend = encoder.backend

    class Recording:
        def __getattr__(self, name):
            method = getattr(backend, name)
            return lambda *a, **k: calls.append(name) or method(*a, **k)

    monkeypatch.setattr(encoder, "backend", Recording())
    texts = ["def f(x):\n    return x  # café ☕", "  two  spaces\tand a tab", "ünïcödé and emoji 🚀 end"]
    chunk = tokenize_rendered([Rendered(t, None, True, f"x:{i}") for i, t in enumerate(texts)], tok, 512, "truncate")
    assert calls == ["encode_batch_fast"]
    want = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert chunk.ids.tolist() == [i for ids in want for i in ids] and chunk.lengths.tolist() == [len(w) for w in want]
    r = Renderer("prompt_completion", FieldNames(), tok)(Row({"prompt": "alpha", "completion": " beta"}, "x:1"))
    tokenize_rendered([r], tok, 512, "truncate")
    assert calls == ["encode_batch_fast", "encode_batch"]


def test_prompt_completion_learns_completion_and_eos_only(tok):
    r = Renderer("prompt_completion", FieldNames(), tok)(Row({"prompt": "continue: alpha beta", "completion": " gamma delta"}, "x:1"))
    ids, targets = learned_targets(tok, r)
    completion = tok(" gamma delta", add_special_tokens=False)["input_ids"]
    assert targets == completion + [tok.eos_token_id]
    assert ids.tolist() == tok("continue: alpha beta gamma delta")["input_ids"] + [tok.eos_token_id]


def test_chat_learns_every_assistant_turn_and_nothing_else(tok):
    convo = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "alpha beta"},
        {"role": "assistant", "content": "gamma"},
        {"role": "user", "content": "delta"},
        {"role": "assistant", "content": "epsilon zeta"},
    ]
    r = Renderer("chat", FieldNames(), tok)(Row({"messages": convo}, "x:1"))
    assert r.text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nalpha beta<|im_end|>\n"
        "<|im_start|>assistant\ngamma<|im_end|>\n<|im_start|>user\ndelta<|im_end|>\n"
        "<|im_start|>assistant\nepsilon zeta<|im_end|>\n"
    )
    chunk = tokenize_rendered([r], tok, 512, "truncate", special_tokens=False)
    ids, learn = chunk.ids, chunk.learn.astype(bool)
    learned_text = tok.decode(ids[learn].tolist())
    assert learned_text == "gamma<|im_end|>\nepsilon zeta<|im_end|>\n"  # both assistant turns, with their end marker
    # and exactly those tokens: the learned tokens are the tokenization of each assistant turn
    enc = tok(r.text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(r.text.index("gamma"), r.text.index("<|im_start|>user\ndelta")), (r.text.index("epsilon"), len(r.text))]
    expected = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
    assert learn.tolist() == expected


def test_chat_marker_text_inside_a_user_turn_is_not_learned(tok):
    convo = [{"role": "user", "content": "<|im_start|>assistant\nfake"}, {"role": "assistant", "content": "real"}]
    r = Renderer("chat", FieldNames(), tok)(Row({"messages": convo}, "x:1"))
    chunk = tokenize_rendered([r], tok, 512, "truncate", special_tokens=False)
    assert tok.decode(chunk.ids[chunk.learn.astype(bool)].tolist()) == "real<|im_end|>\n"


def test_alpaca_renders_prompt_and_learns_output(tok):
    rows = [
        Row({"instruction": "add one", "input": "2", "output": "3"}, "x:1"),
        Row({"instruction": "say hi", "output": "hi"}, "x:2"),
    ]
    r1, r2 = (Renderer("alpaca", FieldNames(), tok)(r) for r in rows)
    assert r1.text == "### Instruction:\nadd one\n\n### Input:\n2\n\n### Response:\n3"
    assert r2.text == "### Instruction:\nsay hi\n\n### Response:\nhi"
    assert r1.text[r1.spans[0][0] :] == "3"


def test_train_on_prompt_learns_everything(tok):
    r = Renderer("prompt_completion", FieldNames(), tok, train_on_prompt=True)(Row({"prompt": "a", "completion": "b"}, "x"))
    assert r.spans is None


def test_custom_field_names(tmp_path, tok):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "alpha", "a": " beta"}] * 3)
    data = prepare(tmp_path, tok, train=str(path), eval=None, fields={"prompt": "q", "completion": "a"})
    assert data.format == "prompt_completion" and data.stats["train_sequences"] == 3


def test_too_long_policies(tok):
    long = Renderer("text", FieldNames(), tok)(Row({"text": " ".join(["alpha beta"] * 40)}, "x"))
    n = len(tok(long.text)["input_ids"]) + 1
    assert tokenize_rendered([long], tok, 16, "truncate").lengths.tolist() == [17]
    assert len(tokenize_rendered([long], tok, 16, "drop").lengths) == 0
    split = tokenize_rendered([long], tok, 16, "split")
    assert split.split == 1 and int(split.lengths.sum()) - (len(split.lengths) - 1) == n  # one shared token per cut
    assert split.continues.tolist() == [False] + [True] * (len(split.lengths) - 1)  # concat skips the shared token
    pc = Renderer("prompt_completion", FieldNames(), tok)(Row({"prompt": " ".join(["alpha"] * 50), "completion": " beta"}, "x"))
    assert tokenize_rendered([pc], tok, 16, "truncate").dropped_masked == 1  # the completion was cut away


# ---------------------------------------------------------------- sources


def test_every_file_format_reads_the_same_rows(tmp_path):
    rows = [{"text": "alpha beta"}, {"text": "gamma, \"delta\""}]
    write_jsonl(tmp_path / "d" / "a.jsonl", rows)
    (tmp_path / "d" / "b.json").write_text(json.dumps(rows))
    with open(tmp_path / "d" / "c.csv", "w", newline="") as f:
        import csv

        w = csv.DictWriter(f, ["text"])
        w.writeheader()
        w.writerows(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d" / "e.parquet")
    got = list(iter_source(str(tmp_path / "d"), BadRows()))
    assert [r.data["text"] for r in got] == [r["text"] for r in rows] * 4
    assert [r.where.split("/")[-1] for r in got] == [
        "a.jsonl:1", "a.jsonl:2", "b.json: row 1", "b.json: row 2", "c.csv:2", "c.csv:3", "e.parquet: row 1", "e.parquet: row 2",
    ]


def test_txt_per_file_or_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("first para\nline two\n\n\nsecond para\n")
    whole = list(iter_source(str(tmp_path / "a.txt"), BadRows(), "file"))
    paras = list(iter_source(str(tmp_path / "a.txt"), BadRows(), "paragraph"))
    assert len(whole) == 1
    assert [(r.data["text"], r.where.split("/")[-1]) for r in paras] == [("first para\nline two", "a.txt:1"), ("second para", "a.txt:5")]


def test_weights_mix_sources(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i}"} for i in range(10)])
    data = prepare(tmp_path, tok, train=[{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}], eval=None)
    idx = weighted_indices(data.train, [2.0, 0.5], seed=0)
    assert np.bincount(idx, minlength=20)[:10].tolist() == [2] * 10
    assert np.bincount(idx, minlength=20)[10:].sum() == 5 and np.bincount(idx, minlength=20)[10:].max() == 1


# ---------------------------------------------------------------- eval split and cache


def test_eval_fraction_is_exact_disjoint_and_seeded(tmp_path, tok, toy_data_dir):
    data = prepare(tmp_path, tok, train=str(toy_data_dir / "pc_train.jsonl"), eval=0.1)
    assert data.stats["eval_rows"] == 40 and data.stats["train_rows"] == 360 and data.stats["train_sequences"] == 360


def test_duplicates_never_straddle_train_and_eval(tmp_path, tok):
    rows = [{"text": f"doc {i % 5}"} for i in range(50)]  # 5 distinct documents, 10 copies each
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    data = prepare(tmp_path, tok, train=str(path), eval=0.2)
    decode = lambda store: {tok.decode(store.sequence(i)[0].tolist()) for i in range(len(store))}
    assert decode(data.train).isdisjoint(decode(data.eval))
    ev = write_jsonl(tmp_path / "ev.jsonl", rows[:2])
    separate = prepare(tmp_path, tok, train=str(path), eval=str(ev))
    assert separate.stats["eval_overlap_dropped"] == 20 and separate.stats["train_sequences"] == 30


def test_cache_hit_and_rebuilds(tmp_path, tok, tiny_model_dir):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"alpha beta {i}"} for i in range(30)])
    first = prepare(tmp_path, tok, train=str(path), eval=0.1, max_length=32)
    again = prepare(tmp_path, tok, train=str(path), eval=0.1, max_length=32)
    assert not first.cache_hit and again.cache_hit and again.cache_path == first.cache_path
    assert np.array_equal(np.asarray(again.train.ids), np.asarray(first.train.ids))
    assert prepare(tmp_path, tok, train=str(path), eval=0.1, max_length=32, packing=False).cache_hit  # packing: load-time only
    assert not prepare(tmp_path, tok, train=str(path), eval=0.1, max_length=16).cache_hit  # a setting
    other = load_tokenizer(tiny_model_dir)
    other.add_tokens(["<extra>"])
    assert not prepare(tmp_path, other, train=str(path), eval=0.1, max_length=32).cache_hit  # the tokenizer
    write_jsonl(path, [{"text": f"alpha beta {i}"} for i in range(31)])
    assert not prepare(tmp_path, tok, train=str(path), eval=0.1, max_length=32).cache_hit  # the file


def test_parallel_workers_give_the_same_tokens(tmp_path, tok, toy_data_dir):
    one = prepare(tmp_path / "a", tok, train=str(toy_data_dir / "pc_train.jsonl"), eval=0.1)
    cfg = DataSettings(train=str(toy_data_dir / "pc_train.jsonl"), eval=0.1, cache_dir=tmp_path / "b", num_workers=2)
    two = prepare_data(cfg, tok, seed=0, log=quiet)
    assert np.array_equal(np.asarray(one.train.ids), np.asarray(two.train.ids))
    assert np.array_equal(one.train.offsets, two.train.offsets)


def test_token_dtype_follows_vocabulary(tmp_path):
    assert make_store(tmp_path / "s", [([1, 2], [1, 1])], vocab_size=50_000).ids.dtype == np.uint16
    assert make_store(tmp_path / "l", [([1, 2], [1, 1])], vocab_size=100_000).ids.dtype == np.uint32


# ---------------------------------------------------------------- packing and batching


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1025, size=2000)
    rows = best_fit_decreasing(lengths, 1024)
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(2000))
    assert all(lengths[r].sum() <= 1024 for r in rows)
    assert lengths.sum() / (len(rows) * 1024) > 0.97  # near-perfect on varied lengths


def test_concat_blocks_cover_every_target_once(tmp_path):
    store = make_store(tmp_path / "s", [(list(range(7)), [1] * 7), (list(range(100, 105)), [1] * 5)])
    rows = concat_rows(store, np.arange(2), max_length=4)
    collate = RowCollator(store, 0, "concat", 4)
    batch = collate(rows, list(range(len(rows))))
    stream = list(range(7)) + list(range(100, 105))
    labels = batch.labels[batch.labels != IGNORE].tolist()
    assert labels == stream[1:] and batch.position_ids is None


def test_packed_rows_restart_positions_and_pad_to_fixed_width(tmp_path):
    store = make_store(tmp_path / "s", [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [1, 1, 1])])
    rows = build_rows(store, np.arange(2), True, max_length=8)
    assert len(rows) == 1
    batch = RowCollator(store, 0, True, 8)(rows, [0])
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 6, 0, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE, 3, 4, 6, 7, IGNORE, IGNORE, IGNORE]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch.n_tokens == 5 and batch.n_targets == 4


def test_packed_documents_are_isolated(tiny_model_dir, tmp_path):
    """Per-document losses of a packed row equal those of each document run alone (fp32, 1e-5)."""
    from trainforge.config.run import ModelSettings
    from trainforge.model.load import build_model

    tok = load_tokenizer(tiny_model_dir)
    model = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, len(tok), (n,), generator=gen).tolist() for n in (9, 14, 5, 20)]
    store = make_store(tmp_path / "s", [(d, [1] * len(d)) for d in docs], len(tok))
    packed = RowCollator(store, tok.pad_token_id, True, 64)(build_rows(store, np.arange(4), True, 64), [0])
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        per_token = torch.nn.functional.cross_entropy(logits[0], packed.labels[0], ignore_index=IGNORE, reduction="none")
        # locate each document in the packed row by its position-id restarts
        starts = (packed.position_ids[0] == 0).nonzero().flatten().tolist()
        for doc in docs:
            alone = model(input_ids=torch.tensor([doc[:-1]])).logits[0]
            loss_alone = torch.nn.functional.cross_entropy(alone, torch.tensor(doc[1:]), reduction="none")
            s = next(s for s in starts if packed.input_ids[0, s : s + len(doc) - 1].tolist() == doc[:-1])
            torch.testing.assert_close(per_token[s : s + len(doc) - 1], loss_alone, rtol=0, atol=1e-5)
        # and without position ids (cross-document attention) the losses would differ
        leaky = model(input_ids=packed.input_ids, use_cache=False).logits
        assert not torch.allclose(leaky, logits, atol=1e-3)


def test_unpacked_batches_are_length_grouped_and_batch_size_invariant(tmp_path):
    rng = np.random.default_rng(1)
    seqs = [(list(range(n)), [1] * n) for n in rng.integers(2, 60, size=100)]
    store = make_store(tmp_path / "s", seqs)
    rows = build_rows(store, np.arange(100), False, 64)
    collate = RowCollator(store, 0, False, 64)
    big = TrainLoader(rows, collate, 8, seed=3, group_by_length=True)
    small = TrainLoader(rows, collate, 4, seed=3, group_by_length=True)
    it_big, it_small = iter(big), iter(small)
    order_big = [i for _ in range(5) for i in next(it_big).indices]
    order_small = [i for _ in range(10) for i in next(it_small).indices]
    assert order_big == order_small  # halving the micro-batch consumes the same rows in the same order
    assert big.padding_efficiency() > TrainLoader(rows, collate, 8, seed=3, group_by_length=False).padding_efficiency()


def test_loader_epoch_visits_each_row_once_and_restores_position(tmp_path):
    store = make_store(tmp_path / "s", [([i, i + 1], [1, 1]) for i in range(10)])
    rows = build_rows(store, np.arange(10), False, 8)
    collate = RowCollator(store, 0, False, 8)
    loader = TrainLoader(rows, collate, 3, seed=5, group_by_length=False)
    it = iter(loader)
    epoch0 = [i for _ in range(4) for i in next(it).indices]
    assert sorted(epoch0) == list(range(10))
    state = loader.state_dict()
    nxt = next(it).indices
    resumed = TrainLoader(rows, collate, 3, seed=5, group_by_length=False)
    resumed.load_state_dict(state)
    assert next(iter(resumed)).indices == nxt


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b'{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:3: malformed JSON"),
        (b'{"text": "ok"}\n\xff\xfe\n', "bad.jsonl:2: not valid UTF-8"),
        (b'{"text": "ok"}\n[1, 2]\n', "bad.jsonl:2: expected a JSON object"),
        (b'{"text": "ok"}\n{"text": 3}\n', "bad.jsonl:2: field 'text' must be a string, got int"),
        (b'{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: field 'text' is missing"),
        (b'{"text": "ok"}\n{"text": null, "id": 2}\n', "bad.jsonl:2: field 'text' is null"),  # was "missing field 'text'"
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, tok, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=fragment.replace(".", r"\.")) as e:
        prepare(tmp_path, tok, train=str(path), eval=None)
    assert str(e.value).endswith("(to skip such rows and count them instead, set data.on_bad_row: skip)")
    skipped = prepare(tmp_path, tok, train=str(path), eval=None, on_bad_row="skip")
    assert skipped.stats["bad_rows"] == 1 and fragment.split(": ", 1)[0] in skipped.stats["bad_row_examples"][0]


def test_bad_csv_and_chat_rows_are_located(tmp_path, tok):
    path = tmp_path / "t.csv"
    path.write_text("text\nok\n\"a\",\"b\"\n")
    with pytest.raises(DataError, match=r"t\.csv:3: 2 cells but the header names 1"):
        prepare(tmp_path, tok, train=str(path), eval=None)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: messages\[1\] must be an object with string 'role' and 'content'"):
        prepare(tmp_path, tok, train=str(chat), eval=None)


def test_empty_or_fully_masked_data_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": " ".join(["alpha"] * 80), "completion": " beta"}] * 3)
    with pytest.raises(DataError, match="no training example has a token to learn: all 3 examples lost every learned "
                                        "token to data.max_length 16 .*the prompt fills the row.*raise data.max_length"):
        prepare(tmp_path, tok, train=str(path), eval=None, max_length=16)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": " ".join(["alpha"] * 12), "chosen": " beta", "rejected": " gamma"}] * 2)
    with pytest.raises(DataError, match="all 2 examples lost.*max_length 16 .*each keeps its first 9 tokens"):
        prepare(tmp_path, tok, train=str(pairs), eval=None, max_length=16)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows found"):
        prepare(tmp_path, tok, train=str(tmp_path / "empty.jsonl"), eval=None)


def test_isolation_holds_for_a_model_whose_config_enables_the_kv_cache(tiny_model_dir, tmp_path):
    """A saved model has use_cache=True; the training forward must still isolate packed documents."""
    from trainforge.config.run import ModelSettings
    from trainforge.data.formats import IGNORE as _IGNORE
    from trainforge.engine.step import loss_sum
    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.load import build_model

    tok = load_tokenizer(tiny_model_dir)
    model = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0).eval()
    model.config.use_cache = True
    docs = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    store = make_store(tmp_path / "s", [(d, [1] * len(d)) for d in docs], len(tok))
    packed = RowCollator(store, tok.pad_token_id, True, 16)(build_rows(store, np.arange(2), True, 16), [0])
    single = RowCollator(store, tok.pad_token_id, False, 16)
    with torch.no_grad():
        together = loss_sum(model, packed, PRECISIONS["fp32"])
        alone = sum(loss_sum(model, single([r], [0]), PRECISIONS["fp32"]) for r in build_rows(store, np.arange(2), False, 16))
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-4)


def test_files_of_two_formats_in_one_source_are_named_as_such(tmp_path, tok):
    chat = write_jsonl(tmp_path / "mixed" / "a_chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    write_jsonl(tmp_path / "mixed" / "b_alpaca.jsonl", [{"instruction": "say", "output": "hi"}])
    with pytest.raises(DataError, match=r"b_alpaca\.jsonl:1: this row is alpaca data .* but its source is read as chat .*a source of their own"):
        prepare(tmp_path, tok, train=str(chat.parent), eval=None)


def test_the_data_line_writes_counts_as_numbers_are_read():
    """'299999 split into blocks' and 'eval 1 rows': counts with thousands separators, one row singular."""
    from types import SimpleNamespace

    from trainforge.data.plan import describe_data

    stats = {"format": "text", "train_rows": 1200, "train_sequences": 300000, "train_tokens": 2_000_000,
             "split": 299999, "eval_rows": 1}
    plan = SimpleNamespace(prepared=SimpleNamespace(stats=stats), collate=SimpleNamespace(packed=True, concat=False),
                           train_rows=[0] * 5000)
    line = describe_data(plan, 0.98)
    assert "299,999 split into blocks" in line and "eval 1 row;" in line and "5,000 packed rows" in line


def test_a_csv_messages_cell_holding_json_is_read_as_the_conversation(tmp_path, tok):
    """CSV exports (and string columns) store a conversation as JSON text in one cell: it was refused as "must be a
    non-empty list"; it is parsed, and text that starts like a list but does not parse is said as such."""
    import csv
    import json

    messages = [{"role": "user", "content": "hi, there"}, {"role": "assistant", "content": "hello \"you\""}]
    path = tmp_path / "chat.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["id", "messages"], [1, json.dumps(messages)], [2, json.dumps(messages)]])
    prepared = prepare(tmp_path, tok, train=str(path), eval=None)
    assert prepared.format == "chat" and prepared.stats["train_sequences"] == 2
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["id", "messages"], [1, json.dumps(messages)[:-1]]])
    with pytest.raises(DataError, match=r"chat\.csv:2: field 'messages' holds text that starts like a JSON list but does not parse"):
        prepare(tmp_path, tok, train=str(path), eval=None)


def _killed_by_the_system(rows):
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a worker


def test_a_tokenizer_worker_killed_is_said_with_what_to_do(tmp_path, tok, toy_data_dir, monkeypatch):
    """A worker ended by the OOM killer broke the pool: a BrokenProcessPool traceback and exit 1. Now exit 4 (out
    of memory) with data.num_workers to lower; nothing is cached."""
    import trainforge.data.prepare as prepare_module
    from trainforge.config.data import DataSettings
    from trainforge.data.workers import WorkerDied

    monkeypatch.setattr(prepare_module, "_tokenize_chunk", _killed_by_the_system)
    cfg = DataSettings(train=str(toy_data_dir / "pc_train.jsonl"), eval=None, cache_dir=tmp_path / "c", num_workers=2)
    with pytest.raises(WorkerDied, match="a tokenizer worker process died while tokenizing .*lower data.num_workers") as e:
        prepare_data(cfg, tok, seed=0, log=quiet)
    assert e.value.exit_code == 4
    assert not list((tmp_path / "c" / "data").glob("*/stats.json"))
