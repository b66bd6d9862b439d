"""A corpus of many files is tokenized file by file: the same bytes as one stream, and a stopped prepare resumes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import write_jsonl
from trainforge.config.data import DataSettings
from trainforge.data.shards import MANIFEST, units_dir

STORE_FILES = ("ids.bin", "learn.bin", "offsets.npy", "sources.npy", "continues.npy", "meta.json")


@pytest.fixture
def tok(tiny_tokenizer_dir):
    from trainforge.model.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


def _rows(n: int, seed: int) -> list[dict]:
    return [{"text": f"shard {seed} document {i} " + "alpha beta gamma " * (1 + (i * 7 + seed) % 9)} for i in range(n)]


def _corpus(d: Path, shards: int = 4, rows: int = 40) -> Path:
    d.mkdir(parents=True)
    for s in range(shards - 1):
        write_jsonl(d / f"part-{s:02d}.jsonl", _rows(rows, s))
    with gzip.open(d / f"part-{shards - 1:02d}.jsonl.gz", "wt") as f:  # gzip shards are units too
        f.writelines(json.dumps(r) + "\n" for r in _rows(rows, shards - 1))
    return d


def _prepare(train, cache: Path, tok, between=None, **data):
    from trainforge.data.prepare import prepare_data

    said: list[str] = []
    cfg = DataSettings(train=train, cache_dir=cache, num_workers=1, **data)
    return prepare_data(cfg, tok, seed=0, log=said.append, between_chunks=between), said


def _bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("data", [{"eval": 0.1}, {"eval": 0.1, "too_long": "split", "max_length": 8}, {"eval": None}])
def test_shards_store_the_tokens_of_one_stream(tmp_path, tok, data):
    corpus = _corpus(tmp_path / "corpus")
    whole = tmp_path / "whole.jsonl"  # the same rows in one file: tokenized as one stream
    write_jsonl(whole, [r for s in range(4) for r in _rows(40, s)])
    sharded, said = _prepare(str(corpus), tmp_path / "c1", tok, **data)
    assert sum("data: shard " in s and " done: " in s and "tokens/s, ETA" in s for s in said) == 4, said
    one, _ = _prepare(str(whole), tmp_path / "c2", tok, **data)
    for side in ("train", "eval") if data["eval"] else ("train",):
        for name in STORE_FILES:
            assert (sharded.cache_path / side / name).read_bytes() == (one.cache_path / side / name).read_bytes(), (side, name)
    assert {k: v for k, v in sharded.stats.items() if k != "prepare_s"} == {k: v for k, v in one.stats.items() if k != "prepare_s"}
    assert not units_dir(sharded.cache_path).exists()  # published: the shards are gone


def test_a_stopped_prepare_reuses_its_finished_shards_and_ends_with_the_same_entry(tmp_path, tok):
    corpus = _corpus(tmp_path / "corpus", shards=5, rows=30)
    cache = tmp_path / "cache"

    class Stop(Exception):
        pass

    def stop_after_two_shards() -> None:
        manifests = list((cache / "data").glob(f".*.units/{MANIFEST}"))
        if manifests and len(json.loads(manifests[0].read_text())["units"]) >= 2:
            raise Stop

    with pytest.raises(Stop):
        _prepare(str(corpus), cache, tok, between=stop_after_two_shards, eval=0.1)
    assert not any(p.is_dir() and not p.name.startswith(".") for p in (cache / "data").iterdir())  # no entry published
    (corpus / "part-01.jsonl").touch()  # a changed file's shard is tokenized again
    resumed, said = _prepare(str(corpus), cache, tok, eval=0.1)
    assert any("reusing 1 of 5 shards" in s for s in said), said
    assert sum(" done: " in s for s in said) == 4, said
    fresh, _ = _prepare(str(corpus), tmp_path / "fresh", tok, eval=0.1)
    assert resumed.cache_path.name == fresh.cache_path.name
    assert _bytes(resumed.cache_path) == _bytes(fresh.cache_path)
    assert not units_dir(resumed.cache_path).exists()
