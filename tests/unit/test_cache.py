"""Publishing a token-cache entry through the one atomic protocol (``atomic.publish_dir``): the first
complete entry wins and is never replaced, a damaged one is, a dead build's temporary is removed."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainforge.rundir.atomic import staging_dir
from trainforge.data.cache import publish_entry


def writes(text: str):
    def write(tmp: Path) -> None:
        (tmp / "train").mkdir()
        (tmp / "train" / "ids.bin").write_bytes(b"\0" * 64)
        (tmp / "stats.json").write_text(text)  # what makes an entry complete

    return write


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_complete_entry_landing_while_a_damaged_one_is_replaced_is_kept(tmp_path, monkeypatch):
    """The damaged entry is checked, then another process publishes its complete entry before this one
    parks what it checked: the complete entry stays, this process uses it (it is never replaced)."""
    root = tmp_path / "data" / "key"
    root.mkdir(parents=True)
    (root / "train").mkdir()  # a hand copy without stats.json: damaged
    racer = tmp_path / "racer"
    racer.mkdir()
    writes("racer")(racer)
    real_rename = os.rename

    def rename(src, dst):
        if Path(dst).name.startswith(".key.old-") and racer.exists():  # about to park the damaged entry
            shutil.rmtree(root)
            real_rename(racer, root)  # the other process got there first
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    assert publish_entry(root, writes("mine")) is False
    assert (root / "stats.json").read_text() == "racer"
    assert hidden(root.parent) == []


def test_a_damaged_entry_is_replaced_and_a_complete_one_is_not(tmp_path):
    root = tmp_path / "data" / "key"
    (root / "train").mkdir(parents=True)  # no stats.json
    assert publish_entry(root, writes("first")) is True
    assert (root / "stats.json").read_text() == "first"
    assert publish_entry(root, writes("second")) is False
    assert (root / "stats.json").read_text() == "first"
    assert hidden(root.parent) == []


def test_a_failed_build_leaves_nothing(tmp_path):
    root = tmp_path / "data" / "key"

    def fail(tmp: Path) -> None:
        (tmp / "stats.json").write_text("half")
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        publish_entry(root, fail)
    assert not root.exists() and hidden(root.parent) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_builds_temporary_is_removed_by_the_next_publisher(tmp_path):
    root = tmp_path / "data" / "key"
    root.parent.mkdir(parents=True)
    host, _, rand = staging_dir(root).name.rsplit("-", 2)
    dead = root.parent / f"{host}-{_dead_pid()}-{rand}"  # a build whose process was killed
    dead.mkdir()
    writes("half")(dead)
    other = root.parent / f".other.tmp-{host}-{os.getpid()}-abcdef"  # a live build of another entry
    other.mkdir()
    assert publish_entry(root, writes("mine")) is True
    assert hidden(root.parent) == [other.name]


def _publish(root: str, tag: str, go, results) -> None:
    def write(tmp: Path) -> None:
        writes(tag)(tmp)
        go.wait()  # every publisher has built its copy before any renames: they all race

    results.put((tag, publish_entry(Path(root), write)))


def test_concurrent_publishers_of_one_entry_leave_one_complete_entry(tmp_path):
    root = tmp_path / "data" / "key"
    ctx = multiprocessing.get_context("fork")
    go, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_publish, args=(str(root), f"p{k}", go, results)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    outcomes = dict(results.get(timeout=5) for _ in procs)
    winners = [tag for tag, published in outcomes.items() if published]
    assert len(winners) == 1 and (root / "stats.json").read_text() == winners[0]
    assert sorted(p.name for p in root.parent.iterdir()) == ["key"]  # no temporaries left


def test_a_tokenizer_trained_on_the_data_is_trained_once_and_loaded_after(tmp_path, toy_data_dir):
    import io

    from rich.console import Console

    from trainforge.config.run import RunConfig
    from trainforge.data.cache import tokenizer_fingerprint
    from trainforge.data.plan import get_tokenizer
    from trainforge.metrics.console import ConsoleReporter

    def tokenizer(vocab: int, source: str = "text_train.jsonl"):
        cfg = RunConfig.model_validate({
            "model": {"init": {"architecture": "llama"}, "tokenizer_vocab_size": vocab},
            "data": {"train": str(toy_data_dir / source), "cache_dir": str(tmp_path / "cache")},
        })
        said = io.StringIO()
        tok = get_tokenizer(cfg, ConsoleReporter(Console(file=said, width=300)))
        return tok, said.getvalue()

    first, said = tokenizer(300)
    assert "trained on the data" in said and len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    again, said = tokenizer(300)
    assert "loaded from" in said
    # the same tokenizer: the token cache's key and a resume's vocabulary check see no difference
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(first)
    assert again("one two three").input_ids == first("one two three").input_ids
    assert (again.eos_token_id, again.pad_token_id) == (first.eos_token_id, first.pad_token_id)
    assert "trained on the data" in tokenizer(320)[1]  # another vocabulary size
    assert "trained on the data" in tokenizer(300, "pc_train.jsonl")[1]  # other data


def test_later_field_names_leave_existing_keys_alone_until_renamed(toy_data_dir):
    """data.fields.chosen/rejected/label came after stores were keyed by the data settings: at their defaults
    they are not hashed, so a run started before keeps its store (and resumes: a checkpoint names its store's
    key); renaming one is a different store."""
    from trainforge.config.data import DataSettings
    from trainforge.data.cache import LATER_FIELD_NAMES, _settings, built_tokenizer_key, fingerprint
    from trainforge.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(["abc"])
    base = DataSettings(train=str(toy_data_dir / "pc_train.jsonl"), eval=None)
    older = base.model_dump(mode="json")["fields"]  # what versions before these names hashed
    for name in LATER_FIELD_NAMES:
        del older[name]
    assert _settings(base, set())["fields"] == older
    key = fingerprint(base, "preference", tok, 0)
    for name in LATER_FIELD_NAMES:
        renamed = base.model_copy(update={"fields": base.fields.model_copy(update={name: "other"})})
        assert _settings(renamed, set())["fields"] == {**older, name: "other"}
        assert fingerprint(renamed, "preference", tok, 0) != key
        assert built_tokenizer_key(renamed, "preference", 64) != built_tokenizer_key(base, "preference", 64)


def test_default_chat_template_is_part_of_a_chat_key(toy_data_dir, monkeypatch):
    """Chats of a tokenizer without a template render with trainforge's default: a changed default is a
    different store (no stale tokens from an older one); a tokenizer's own template, or data.chat_template,
    keys the store instead, and text stores do not depend on it."""
    import trainforge.data.cache as cache
    from trainforge.config.data import DataSettings
    from trainforge.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(["abc"])
    assert not getattr(tok, "chat_template", None)
    cfg = DataSettings(train=str(toy_data_dir / "pc_train.jsonl"), eval=None)
    keys = {fmt: cache.fingerprint(cfg, fmt, tok, 0) for fmt in ("chat", "preference", "text")}
    monkeypatch.setattr(cache, "DEFAULT_CHAT_TEMPLATE", cache.DEFAULT_CHAT_TEMPLATE + " ")
    assert cache.fingerprint(cfg, "chat", tok, 0) != keys["chat"]
    assert cache.fingerprint(cfg, "preference", tok, 0) != keys["preference"]
    assert cache.fingerprint(cfg, "text", tok, 0) == keys["text"]
    own = cfg.model_copy(update={"chat_template": "{{ messages }}"})
    before = cache.fingerprint(own, "chat", tok, 0)
    monkeypatch.setattr(cache, "DEFAULT_CHAT_TEMPLATE", cache.DEFAULT_CHAT_TEMPLATE + " ")
    assert cache.fingerprint(own, "chat", tok, 0) == before


def test_chat_rendering_rules_are_part_of_a_chat_key(toy_data_dir, monkeypatch):
    """Chat rows render otherwise from CHAT_VERSION 2 on (a row's tools, parsed call arguments, function_call turns,
    weight 0 turns, refused rows): stores of messages rendered before are stale; text and prompt/completion stores
    keep their keys."""
    import trainforge.data.cache as cache
    from trainforge.config.data import DataSettings
    from trainforge.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(["abc"])
    cfg = DataSettings(train=str(toy_data_dir / "pc_train.jsonl"), eval=None, chat_template="{{ messages }}")
    formats = ("chat", "preference", "unpaired", "text", "prompt_completion")
    keys = {fmt: cache.fingerprint(cfg, fmt, tok, 0) for fmt in formats}
    monkeypatch.setattr(cache, "CHAT_VERSION", cache.CHAT_VERSION + 1)
    changed = {fmt for fmt in formats if cache.fingerprint(cfg, fmt, tok, 0) != keys[fmt]}
    assert changed == {"chat", "preference", "unpaired"}
