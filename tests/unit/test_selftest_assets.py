"""Selftest's assets when several selftests share one cache directory: each writer builds in a
temporary of its own (``trainforge.rundir.atomic``), so two writers of the same asset both succeed and
the asset that appears is complete, one writer's whole."""

from __future__ import annotations

import json
import threading
from pathlib import Path

# imported here, once: transformers' lazy imports race when two threads make the first import at
# once (the run config checks the model's architecture with it); two selftests are two processes
from transformers import CONFIG_MAPPING  # noqa: F401

import trainforge.engine.trainer as trainer_module
import trainforge.model.tokenizer as tokenizer_module
from trainforge.tools.selftest import assets as assets_module
from trainforge.tools.selftest import build_assets


def hidden(directory: Path) -> list[str]:
    """Temporaries (and parked copies) left in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_writer_that_starts_while_another_is_midway_does_not_break_it(tmp_path, monkeypatch):
    """The second selftest builds the tokenizer entirely while the first is half-way through
    writing it: both finish, and the tokenizer directory holds one writer's complete files.
    (With one fixed ``.tokenizer.tmp`` for every writer, the second deleted the first's.)"""
    writers = []

    class Tokenizer:
        def save_pretrained(self, directory):
            me = len(writers)
            writers.append(me)
            Path(directory).mkdir(parents=True, exist_ok=True)  # as transformers' save_pretrained does
            (Path(directory) / "tokenizer.json").write_text(json.dumps({"writer": me}))
            if me == 0:  # the other selftest comes and finishes meanwhile
                build_assets(tmp_path)
            (Path(directory) / "tokenizer_config.json").write_text(json.dumps({"writer": me}))

    def pretrain(root, tokenizer, text, model_dir, cache_dir):  # no training: the model's config only
        def write(tmp):
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "config.json").write_text("{}")

        assets_module.publish_dir(model_dir, write, lambda d: (d / "config.json").is_file())

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", lambda texts, vocab_size: Tokenizer())
    monkeypatch.setattr(assets_module, "_pretrain", pretrain)

    built = build_assets(tmp_path)

    assert writers == [0, 1]
    files = {p.name: json.loads(p.read_text()) for p in built.tokenizer.iterdir()}
    assert set(files) == {"tokenizer.json", "tokenizer_config.json"}
    assert len({f["writer"] for f in files.values()}) == 1, files  # not a mix of two writers
    assert hidden(built.root) == []
    assert all(a.is_file() and b.is_file() for a, b in built.data.values())


def test_two_selftests_pretraining_at_once_both_succeed(tmp_path, monkeypatch):
    """Two writers of the "pretrained" model train at the same time: each run has a directory of
    its own, both succeed, the model directory is one writer's complete copy, nothing is left."""
    root = tmp_path / "assets"
    (root / "tokenizer").mkdir(parents=True)
    (root / "tokenizer" / "tokenizer.json").write_text("{}")  # only looked at, never loaded: no real run
    text = root / "pretrain_train.jsonl"
    text.write_text(json.dumps({"text": "alpha beta."}) + "\n")
    both_training = threading.Barrier(2, timeout=60)
    runs = []

    def train(cfg, out, reporter, resume):
        runs.append(Path(out))
        (Path(out) / "final").mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (Path(out) / "final" / name).write_text(json.dumps({"run": str(out)}))
        both_training.wait()  # the other writer is training too

    monkeypatch.setattr(trainer_module, "train", train)
    errors = []

    def writer():
        try:
            assets_module._pretrain(root, root / "tokenizer", text, root / "pretrained", None)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    assert errors == []
    assert len(runs) == 2 and runs[0] != runs[1]
    files = {p.name: json.loads(p.read_text())["run"] for p in (root / "pretrained").iterdir()}
    assert set(files) == {"config.json", "model.safetensors"}
    assert len(set(files.values())) == 1, files  # one writer's model, whole
    assert hidden(root) == [] and not any(r.exists() for r in runs)
