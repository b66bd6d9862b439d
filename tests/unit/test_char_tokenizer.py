"""``model.tokenizer: char``: a character vocabulary built from the training text.

Exact: the vocabulary is the sorted characters then EOS, PAD, UNK; text round-trips character
for character; every character is one token whose offsets span exactly that character; the
saved directory loads with plain transformers and gives the same ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY_LLAMA_INIT, write_jsonl

from trainforge.config.run import ConfigError, ModelSettings, load_config
from trainforge.model.tokenizer import EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
    "All:\n\tSpeak,   speak.  \r\n",
    "naïve café — Ünïcödé, e\u0301 (combining) and 😀 (outside the BMP); don't , . ?",
]
TEXTS = [*TRAIN, "\n\n\n", "   ", "a  b\t\tc", "😀😀e\u0301", " . , ' ?"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(TRAIN)


def test_vocab_is_sorted_characters_then_specials(tok):
    chars = sorted(set("".join(TRAIN)))
    expected = {c: i for i, c in enumerate(chars)}
    n = len(chars)
    expected.update({EOS_TOKEN: n, PAD_TOKEN: n + 1, UNK_TOKEN: n + 2})
    assert tok.get_vocab() == expected
    assert len(tok) == n + 3
    assert (tok.eos_token, tok.pad_token, tok.unk_token) == (EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)
    assert (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (n, n + 1, n + 2)
    assert tok.bos_token_id is None


def test_vocab_depends_only_on_the_set_of_characters():
    a = build_char_tokenizer(["ba", "c", "a"])
    b = build_char_tokenizer(iter(["cab"]))  # any iterable, any order or chunking
    assert a.get_vocab() == b.get_vocab() == {"a": 0, "b": 1, "c": 2, EOS_TOKEN: 3, PAD_TOKEN: 4, UNK_TOKEN: 5}
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_no_text_is_an_error():
    with pytest.raises(ValueError, match="no training text"):
        build_char_tokenizer(["", ""])


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_per_character(tok, text):
    vocab = tok.get_vocab()
    ids = tok(text)["input_ids"]  # add_special_tokens=True by default: nothing is added
    assert ids == [vocab[c] for c in text]
    assert tok.decode(ids) == text  # no spaces inserted, no clean-up of " ." or " '"
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    assert tok.decode(ids + [tok.eos_token_id]) == text + EOS_TOKEN
    assert tok.encode(text, add_special_tokens=False) == ids


def test_unknown_characters_are_unk(tok):
    unk, vocab = tok.unk_token_id, tok.get_vocab()
    assert "Z" not in vocab and "€" not in vocab
    ids = tok("aZ€€ b")["input_ids"]
    assert ids == [vocab["a"], unk, unk, unk, vocab[" "], vocab["b"]]  # one UNK per character, not fused
    assert tok.decode(ids, skip_special_tokens=True) == "a b"
    enc = tok.backend_tokenizer.encode("aZ€€ b")
    assert enc.offsets == [(i, i + 1) for i in range(6)]


def test_special_token_strings_in_text_are_the_special_tokens(tok):
    vocab = tok.get_vocab()
    assert tok("a" + EOS_TOKEN + "b")["input_ids"] == [vocab["a"], tok.eos_token_id, vocab["b"]]


@pytest.mark.parametrize("special", [True, False])
def test_offsets_map_each_character_to_its_token(tok, special):
    """What the data pipeline uses: the Rust batch encodings' offsets and char_to_token."""
    encodings = tok.backend_tokenizer.encode_batch(TEXTS, add_special_tokens=special)
    for text, enc in zip(TEXTS, encodings):
        assert len(enc.ids) == len(text)
        assert enc.offsets == [(i, i + 1) for i in range(len(text))]
        assert [enc.char_to_token(i) for i in range(len(text))] == list(range(len(text)))
        assert [enc.token_to_chars(i) for i in range(len(text))] == [(i, i + 1) for i in range(len(text))]
    wrapped = tok(TEXTS, return_offsets_mapping=True, add_special_tokens=special)
    assert [list(map(tuple, o)) for o in wrapped["offset_mapping"]] == [[(i, i + 1) for i in range(len(t))] for t in TEXTS]


def test_loss_mask_spans_are_exact_characters(tok):
    """A prompt/completion row: exactly the completion's characters and the EOS are learned."""
    from trainforge.data.formats import Rendered, tokenize_rendered

    prompt, completion = "All: a b?\n", "Speak,  me."
    text = prompt + completion
    chunk = tokenize_rendered([Rendered(text, [(len(prompt), len(text))], True, "row 1")], tok, 64, "truncate")
    vocab = tok.get_vocab()
    assert chunk.ids.tolist() == [vocab[c] for c in text] + [tok.eos_token_id]
    assert chunk.learn.tolist() == [0] * len(prompt) + [1] * len(completion) + [1]


def test_save_and_load_with_auto_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id) == (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    for text in [*TEXTS, "aZ€ b"]:
        ids = tok(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == text.replace("Z", UNK_TOKEN).replace("€", UNK_TOKEN)
        assert loaded.decode(ids + [loaded.eos_token_id], skip_special_tokens=True) == text.replace("Z", "").replace("€", "")
        assert loaded.backend_tokenizer.encode(text).offsets == [(i, i + 1) for i in range(len(text))]


# ---------------------------------------------------------------- config and trainer


def test_config_accepts_char_and_round_trips(tmp_path):
    settings = ModelSettings(init=dict(TINY_LLAMA_INIT), tokenizer="char")
    assert settings.tokenizer == "char"
    assert settings.model_dump(mode="json")["tokenizer"] == "char"
    assert ModelSettings.model_validate(settings.model_dump(mode="json")) == settings
    build_char_tokenizer(["abc"]).save_pretrained(tmp_path)
    assert ModelSettings(init=dict(TINY_LLAMA_INIT), tokenizer=str(tmp_path)).tokenizer == tmp_path  # a directory


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no-such-dir", "model.tokenizer: path does not exist: no-such-dir (give an existing local tokenizer directory, or 'char')"),
        ("5", "model.tokenizer: expected a local tokenizer directory or 'char'"),
    ],
)
def test_config_rejects_other_values(tmp_path, value, message):
    (tmp_path / "t.txt").write_text("abc")
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            [f"model.tokenizer={value}", f"data.train={tmp_path / 't.txt'}"],
        )
    assert message in str(e.value)


def test_example_config_validates_with_a_train_file(tmp_path, monkeypatch):
    example = ROOT / "examples" / "char-shakespeare.yaml"
    (tmp_path / "shakespeare.txt").write_text("To be, or not to be\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(example, ["data.train=shakespeare.txt"])
    assert cfg.model.tokenizer == "char"
    assert cfg.data.train == "shakespeare.txt" and cfg.data.max_length == 256 and cfg.data.packing == "concat"
    assert cfg.data.too_long == "split" and cfg.optim.lr == 1e-3 and cfg.log.sample_prompt
    with pytest.raises(ConfigError, match=r"data\.train: no file matches 'input.txt'"):
        load_config(example)  # the repository ships no text: the error names the key to set


def _quiet():
    from rich.console import Console

    from trainforge.metrics.console import ConsoleReporter

    return ConsoleReporter(Console(quiet=True))


def test_trainer_builds_the_vocab_of_a_text_file(tmp_path):
    from trainforge.data.plan import get_tokenizer

    text = "".join(TRAIN).replace("\r\n", "\n")  # .txt files are read with universal newlines
    (tmp_path / "input.txt").write_text(text)
    cfg = load_config(None, ["model.tokenizer=char", f"data.train={tmp_path / 'input.txt'}", "data.eval=null"])
    tok = get_tokenizer(cfg, _quiet())
    assert tok.get_vocab() == build_char_tokenizer([text]).get_vocab()


@pytest.mark.parametrize("fmt", ["chat", "tools", "alpaca"])
def test_characters_the_rendering_adds_are_in_the_vocab(tmp_path, fmt):
    """Chat templates and the alpaca prompt add characters the data's fields lack, and a chat row's tool calls and
    definitions characters its contents lack (Ü, @): none is UNK."""
    from trainforge.data.formats import Renderer
    from trainforge.data.sources import Row
    from trainforge.data.plan import get_tokenizer

    if fmt == "chat":
        rows = [{"messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 4
    elif fmt == "tools":
        call = {"type": "function", "function": {"name": "mail", "arguments": {"to": "x@y"}}}
        tool = {"type": "function", "function": {"name": "mail", "description": "Üse it"}}
        rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "yo"}], "tools": [tool]}] * 4
    else:
        rows = [{"instruction": "hi", "input": "x", "output": "yo"}, {"instruction": "hi", "output": "yo"}] * 2
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(None, ["model.tokenizer=char", f"data.train={path}", "data.eval=null", "data.too_long=null"])
    tok = get_tokenizer(cfg, _quiet())
    render = Renderer("chat" if fmt == "tools" else fmt, cfg.data.fields, tok)
    for i, row in enumerate(rows):
        text = render(Row(row, f"row {i}")).text
        assert tok.unk_token_id not in tok(text)["input_ids"], text
