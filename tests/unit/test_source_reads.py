"""Each source of a mixture read its own way: its own format, field names and chat template over the data section's,
tokenized into its own cache entry keyed by them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import write_jsonl
from trainforge.config.data import DataSettings, SourceSpec
from trainforge.config.errors import ConfigError
from trainforge.data.sources import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from trainforge.model.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


def chat_rows(n: int) -> list[dict]:
    """OpenAI-style chat rows (a system, a user and an assistant turn)."""
    return [{"messages": [{"role": "system", "content": "answer briefly"},
                          {"role": "user", "content": f"what follows {WORDS[i % 8]}"},
                          {"role": "assistant", "content": f"{WORDS[(i + 1) % 8]} {WORDS[(i + 2) % 8]}"}]} for i in range(n)]


def gsm8k_rows(n: int) -> list[dict]:
    """GSM8K-shaped rows: {question, answer} (the answer's reasoning, then '#### N')."""
    return [{"question": f"alpha has {i} beta and gets 2 more; how many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
            for i in range(n)]


def prepare(tmp_path, tok, sources, **data):
    from trainforge.data.prepare import prepare_data

    said: list[str] = []
    cfg = DataSettings(train=sources, cache_dir=tmp_path / "cache", num_workers=1, **data)
    return prepare_data(cfg, tok, seed=0, log=said.append), said


def sequences(store, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, learn) of each stored sequence of source ``k``."""
    out = []
    for i in store.source_of(k):
        a, b = int(store.offsets[i]), int(store.offsets[i + 1])
        out.append((np.asarray(store.ids[a:b]), np.asarray(store.learn[a:b]).astype(bool)))
    return out


def test_a_chat_source_and_a_text_source_are_each_tokenized_their_way(tmp_path, tok):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(10)]
    code = write_jsonl(tmp_path / "code.jsonl", [{"text": t} for t in texts])
    sources = [{"path": str(chat), "share": 0.7}, {"path": str(code), "share": 0.3, "format": "text"}]
    prepared, _ = prepare(tmp_path, tok, sources, format="chat", eval=None)
    assert prepared.format == "chat+text" and prepared.stats["source_formats"] == ["chat", "text"]

    rows = chat_rows(12)
    for (ids, learn), row in zip(sequences(prepared.train, 0), rows):
        user, reply = row["messages"][1]["content"], row["messages"][2]["content"]
        whole, learned = tok.decode(ids), tok.decode(ids[learn])
        assert "<|im_start|>user" in whole and user in whole  # rendered with the (default ChatML) template
        assert learned.startswith(reply) and "<|im_end|>" in learned  # the assistant turn and its end marker ...
        assert user not in learned and "answer briefly" not in learned and "<|im_start|>" not in learned  # only
    for (ids, learn), text in zip(sequences(prepared.train, 1), texts):
        assert learn.all() and tok.decode(ids).startswith(text) and "<|im_start|>" not in tok.decode(ids)

    # without its own format the text source would be read as the data section's chat: refused naming it
    from trainforge.data.source_reads import check_source_formats

    plain = DataSettings(train=[sources[0], {**sources[1], "format": None}], format="chat", cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"data.train\[1\] \('.*code.jsonl'\): format 'chat' \(data.format\) needs a "
                                        r"'messages' .*fields \['text'\].*data.train\[1\].format: text"):
        check_source_formats(plain)


def test_per_source_fields_rename_prompt_and_completion(tmp_path, tok):
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"say {w}", "completion": f" {w} {w}"} for w in WORDS])
    gsm = write_jsonl(tmp_path / "math.jsonl", gsm8k_rows(8))
    sources = [{"path": str(pc), "share": 0.5}, {"path": str(gsm), "share": 0.5, "fields": {"prompt": "question", "completion": "answer"}}]
    prepared, _ = prepare(tmp_path, tok, sources, eval=None, fields={"text": "body"})
    cfg = DataSettings(train=sources, fields={"text": "body"})
    # the source's names over the data section's, name by name
    assert (cfg.for_source(1).fields.prompt, cfg.for_source(1).fields.completion, cfg.for_source(1).fields.text) == ("question", "answer", "body")
    assert cfg.for_source(0).fields == cfg.fields
    assert prepared.stats["source_formats"] == ["prompt_completion", "prompt_completion"]
    for (ids, learn), row in zip(sequences(prepared.train, 1), gsm8k_rows(8)):
        assert tok.decode(ids[learn]).startswith(row["answer"]) and row["question"] not in tok.decode(ids[learn])
        assert tok.decode(ids[~learn]).startswith(row["question"])
    # saved as given (only the names set) and read back the same: a run directory's config.yaml merges alike
    again = DataSettings.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json"))))
    assert again.model_dump(mode="json")["train"][1]["fields"] == {"prompt": "question", "completion": "answer"}
    assert again.for_source(1).fields == cfg.for_source(1).fields


def test_changing_one_sources_format_tokenizes_only_that_source(tmp_path, tok):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    # rows with both a prompt/completion and a text: prompt_completion when detected, all learned when read as text
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": f"say {w}", "completion": f" {w}", "text": f"say {w} {w}"} for w in WORDS])
    sources = [{"path": str(chat), "share": 0.5}, {"path": str(both), "share": 0.5}]
    first, said = prepare(tmp_path, tok, sources, eval=0.2)
    assert sum("tokenizing source" in s for s in said) == 2 and first.stats["source_formats"] == ["chat", "prompt_completion"]
    assert not all(learn.all() for _, learn in sequences(first.train, 1))

    sources[1]["format"] = "text"
    second, said = prepare(tmp_path, tok, sources, eval=0.2)
    assert [s.split(" into ")[0] for s in said if "tokenizing" in s] == [f"data: tokenizing source 1 ({both})"]
    assert any(s.startswith(f"data: source 0 ({chat}) cache hit") for s in said)
    assert second.cache_path != first.cache_path and second.stats["source_formats"] == ["chat", "text"]
    assert all(learn.all() for _, learn in sequences(second.train, 1))
    assert second.eval.n_sources == 2  # each source's own rows held out, each read its way
    # the chat source's tokens are the very same bytes
    assert [ids.tolist() for ids, _ in sequences(second.train, 0)] == [ids.tolist() for ids, _ in sequences(first.train, 0)]

    # a source set back: both entries exist, nothing is tokenized
    sources[1]["format"] = None
    third, said = prepare(tmp_path, tok, sources, eval=0.2)
    assert third.cache_path == first.cache_path and third.cache_hit


def test_a_source_without_read_keys_dumps_as_before():
    """A checkpoint binds data.train as dumped: a source that sets none of the new keys must dump as it did."""
    spec = SourceSpec(path="builtin:python-stdlib", share=0.5)
    assert spec.model_dump(mode="json") == {"path": "builtin:python-stdlib", "weight": 1.0, "share": 0.5, "name": None}


def test_keys_of_a_source_are_checked_by_name(tmp_path):
    from trainforge.config.run import load_config

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\n"
        f"data:\n  train:\n    - {{path: {a}, share: 0.5, fomat: text}}\n"
        f"    - {{path: {a}, share: 0.5, max_length: 64, fields: {{promt: question}}}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "data.train.0.fomat: unknown key; did you mean 'format'?" in msg and f"({path}, line 5)" in msg
    assert "data.train.1.max_length: unknown key; it applies to every item of data.train: set data.max_length" in msg
    assert "data.train.1.fields.promt: unknown key; did you mean 'prompt'?" in msg
    path.write_text(
        "model:\n  init: {architecture: llama, hidden_size: 32}\ntrain: {objective: sft}\n"
        f"data:\n  train:\n    - {{path: {a}}}\n    - {{path: {a}, format: preference}}\n"
    )
    with pytest.raises(ConfigError, match=r"data.train.1.format: preference rows train a preference objective"):
        load_config(path)


def test_an_eval_file_is_read_as_the_first_source_and_max_documents_is_shared_in_order(tmp_path, tok):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    code = write_jsonl(tmp_path / "code.jsonl", [{"text": f"def f{i}(): return {i}"} for i in range(10)])
    held = write_jsonl(tmp_path / "held.jsonl", chat_rows(3))
    sources = [{"path": str(chat)}, {"path": str(code), "format": "text"}]
    prepared, _ = prepare(tmp_path, tok, sources, format="chat", eval=str(held))
    # the eval file is chat, as the first source reads it: its replies learned, not its prompts
    assert len(prepared.eval) == 3 and prepared.stats["eval_rows"] == 3
    for (ids, learn), row in zip(sequences(prepared.eval, 0), chat_rows(3)):
        assert tok.decode(ids[learn]).startswith(row["messages"][2]["content"]) and not learn.all()
    cfg = DataSettings(train=sources, format="chat", eval=str(held), cache_dir=tmp_path / "cache")
    from trainforge.data.source_reads import source_settings

    assert source_settings(cfg, 0).eval_file_tokens and not source_settings(cfg, 1).eval_file_tokens

    # max_documents: read in source order, the text source gets what the chat source leaves
    limited, _ = prepare(tmp_path, tok, sources, format="chat", eval=None, max_documents=13)
    assert [len(limited.train.source_of(k)) for k in (0, 1)] == [10, 3] and limited.stats["source_formats"] == ["chat", "text"]
    with pytest.raises(DataError, match=r"data.train\[1\] \('.*code.jsonl'\) gets no rows: data.max_documents \(10\)"):
        prepare(tmp_path, tok, sources, format="chat", eval=None, max_documents=10)


def test_final_carries_the_first_chat_sources_template(tmp_path, tok):
    from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE, trained_chat_template

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    own = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    cfg = DataSettings(train=[{"path": str(a)}, {"path": str(a), "chat_template": own}, {"path": str(a)}])
    assert trained_chat_template("text+chat", cfg, tok, ["text", "chat", "chat"]) == own
    assert trained_chat_template("chat", cfg, tok, ["chat", "chat", "chat"]) == DEFAULT_CHAT_TEMPLATE  # the tokenizer has none
    assert trained_chat_template("text", cfg, tok, ["text", "text", "text"]) is None
