"""Data: formats, label masks, blocks, batching, splits and precise errors for bad rows."""

from __future__ import annotations

import numpy as np
import pytest

from trainforge.config import DataSettings
from trainforge.data.dataset import read_split, tokenize_split
from trainforge.data.formats import IGNORE, pack_blocks, tokenize_prompt_completion
from trainforge.data.loader import TrainLoader, collate, eval_batches
from trainforge.data.sources import DataError, Row, iter_rows, iter_stdlib_sources
from trainforge.model.tokenizer import load_tokenizer

from conftest import write_jsonl


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def test_blocks_cover_every_target_once_and_keep_the_tail():
    docs = [np.arange(0, 7, dtype=np.int32), np.arange(100, 105, dtype=np.int32)]  # 12 tokens
    blocks = pack_blocks(docs, max_length=4)
    stream = np.concatenate(docs)
    assert [len(b.input_ids) for b in blocks] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate([b.labels for b in blocks]), stream[1:])
    np.testing.assert_array_equal(np.concatenate([b.input_ids for b in blocks]), stream[:-1])
    for b in blocks:
        np.testing.assert_array_equal(b.labels[:-1], b.input_ids[1:])  # labels are the next tokens


def test_prompt_tokens_carry_no_loss(tok):
    rows = [Row({"prompt": "continue: alpha beta", "completion": " gamma delta"}, "x:1")]
    (ex,), truncated, dropped = tokenize_prompt_completion(rows, tok, max_length=64)
    p = tok("continue: alpha beta")["input_ids"]
    c = tok(" gamma delta", add_special_tokens=False)["input_ids"]
    full = p + c + [tok.eos_token_id]
    assert truncated == dropped == 0
    np.testing.assert_array_equal(ex.input_ids, full[:-1])
    # targets: nothing for the prompt's own next tokens, every completion token and the final EOS
    expected = [IGNORE] * (len(p) - 1) + c + [tok.eos_token_id]
    np.testing.assert_array_equal(ex.labels, expected)


def test_truncation_is_counted_and_fully_masked_rows_dropped(tok):
    long_prompt = " ".join(["alpha"] * 100)
    rows = [
        Row({"prompt": "continue: alpha", "completion": " " + " ".join(["beta"] * 50)}, "x:1"),
        Row({"prompt": long_prompt, "completion": " beta"}, "x:2"),
    ]
    examples, truncated, dropped = tokenize_prompt_completion(rows, tok, max_length=16)
    assert truncated == 2 and dropped == 1 and len(examples) == 1  # the second row's completion was cut away entirely
    assert len(examples[0].input_ids) == 16


def test_collate_pads_to_multiple_of_8_without_loss_or_attention(tok):
    from trainforge.data.formats import Example

    a = Example(np.arange(5, dtype=np.int32), np.arange(1, 6, dtype=np.int32))
    b = Example(np.arange(11, dtype=np.int32), np.full(11, IGNORE, dtype=np.int32))
    b.labels[-3:] = 7
    batch = collate([a, b], pad_id=0)
    assert tuple(batch.input_ids.shape) == (2, 16)
    assert batch.attention_mask.sum(1).tolist() == [5, 11]
    assert (batch.labels[0, 5:] == IGNORE).all() and (batch.labels[1, 11:] == IGNORE).all()
    assert batch.n_tokens == 16 and batch.n_targets == 8
    same = collate([a, a], pad_id=0)
    assert same.attention_mask is None and tuple(same.input_ids.shape) == (2, 5)


def test_loader_epoch_visits_each_example_once_in_seeded_order():
    from trainforge.data.formats import Example

    examples = [Example(np.array([i, i], dtype=np.int32), np.array([i, i], dtype=np.int32)) for i in range(10)]
    loader = TrainLoader(examples, batch_size=3, pad_id=0, seed=5)
    it = iter(loader)
    epoch0 = [i for _ in range(loader.batches_per_epoch) for i in next(it).indices]
    epoch1 = [i for _ in range(loader.batches_per_epoch) for i in next(it).indices]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled every epoch
    again = iter(TrainLoader(examples, batch_size=3, pad_id=0, seed=5))
    assert [i for _ in range(4) for i in next(again).indices] == epoch0


def test_eval_fraction_is_disjoint_and_seeded(toy_data_dir):
    cfg = DataSettings(train=str(toy_data_dir / "pc_train.jsonl"), eval=0.1)
    a, b = read_split(cfg, seed=0), read_split(cfg, seed=0)
    assert a.format == "prompt_completion"
    assert len(a.eval) == 40 and len(a.train) == 360
    assert {r.where for r in a.eval}.isdisjoint({r.where for r in a.train})
    assert [r.where for r in a.eval] == [r.where for r in b.eval]
    assert [r.where for r in read_split(cfg, seed=1).eval] != [r.where for r in a.eval]


def test_tokenize_split_stats(toy_data_dir, tok):
    cfg = DataSettings(train=str(toy_data_dir / "text_train.jsonl"), eval=str(toy_data_dir / "text_eval.jsonl"), max_length=32)
    data = tokenize_split(read_split(cfg, seed=0), tok, cfg.max_length)
    assert data.stats["train_examples"] == len(data.train) > 0 and len(data.eval) > 0
    assert all(len(e.input_ids) <= 32 for e in data.train)
    assert eval_batches(data.eval, 4, tok.pad_token_id, max_batches=2)[1].indices == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b'{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:3: malformed JSON"),
        (b'{"text": "ok"}\n\xff\xfe\n', "bad.jsonl:2: not valid UTF-8"),
        (b'{"text": "ok"}\n[1, 2]\n', "bad.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=fragment.replace(".", r"\.")):
        list(iter_rows(str(path)))


def test_missing_and_mistyped_fields_are_located(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(DataError, match=r"pc\.jsonl:2: missing field 'completion'"):
        read_split(DataSettings(train=str(path), eval=None, format="prompt_completion"), seed=0)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, {"text": 3}])
    with pytest.raises(DataError, match=r"t\.jsonl:2: field 'text' must be a string, got int"):
        read_split(DataSettings(train=str(path), eval=None), seed=0)
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "a"}])
    with pytest.raises(DataError, match=r"q\.jsonl:1: cannot tell the data format"):
        read_split(DataSettings(train=str(path), eval=None), seed=0)


def test_builtin_stdlib_corpus_is_offline_text():
    docs = list(iter_rows("builtin:python-stdlib", max_documents=5))
    assert len(docs) == 5 and all(d.data["text"].strip() for d in docs)
    assert [d.where for d in docs] == [d.where for d in list(iter_stdlib_sources())[:5]]
