"""Tokenize once: rows -> token stores in a cache keyed by a fingerprint of everything that changes tokens.

Rows are streamed in chunks and tokenized by worker processes; memory is bounded by the
chunk size and the number of chunks in flight, not by the dataset.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import OLD_MARK, fsync_dir, fsync_tree, process_tag, remove_stale_temps, staging_dir
from ..config import DataSettings, default_cache_dir
from .chat import conversation
from .formats import Renderer, TokenizedChunk, detect_format, format_fields, tokenize_rendered
from .sources import BadRows, DataError, Row, iter_source, source_files
from .seq2seq import tokenize_pairs
from .store import StoreWriter, TokenStore, split_store

STORE_VERSION = 1  # bump when the store layout or tokenization rules change
SEQ2SEQ_VERSION = 1  # source -> target stores of encoder-decoder models (data/seq2seq.py): a key of their own
# too_long: split stores mark split continuations (continues.npy) from version 2 on; a key of its
# own, so the stores (and checkpoints' store keys) of every other setting stay valid
SPLIT_VERSION = 2
CHUNK_ROWS = 1024
# a build temporary of another host is left over (its process gone) when nothing in it changed for
# this long; on this host a build whose process no longer runs is removed at once
STALE_BUILD_S = 2 * 3600


@dataclass
class PreparedData:
    train: TokenStore
    eval: TokenStore | None
    format: str
    stats: dict[str, Any]
    cache_path: Path
    cache_hit: bool


def train_rows(cfg: DataSettings, bad: BadRows) -> Iterator[tuple[int, Row]]:
    """(source index, row) over every training source, at most ``max_documents`` rows."""
    rows = ((k, row) for k, spec in enumerate(cfg.sources()) for row in iter_source(spec.path, bad, cfg.txt_mode))
    return islice(rows, cfg.max_documents) if cfg.max_documents else rows


def resolve_format(cfg: DataSettings) -> str:
    if cfg.format != "auto":
        return cfg.format
    bad = BadRows("skip")
    first = next(train_rows(cfg, bad), None)
    if first is None:
        raise DataError(f"data.train={cfg.train!r}: no rows found" + (f"; every row is bad, first: {bad.first[0]}" if bad.count else ""))
    return detect_format(first[1], cfg.fields)


def training_texts(cfg: DataSettings, fmt: str) -> Iterator[str]:
    """The training text, for training a tokenizer on (every string field the format reads)."""
    keys = format_fields(fmt, cfg.fields) + ((cfg.fields.input,) if fmt == "alpaca" else ())
    for _, row in train_rows(cfg, BadRows("skip")):
        if fmt == "chat":  # the contents of the turns, in either message layout
            try:
                yield from (m["content"] for m in conversation(row, cfg.fields.messages, "tool"))
            except DataError:
                pass  # reported with its location when the data is tokenized
            continue
        for key in keys:
            value = row.data.get(key)
            if isinstance(value, str):
                yield value


def row_hash(row: Row, seed: int) -> int:
    """Content hash of a row (seeded): identical rows hash alike, wherever they come from."""
    blob = json.dumps(row.data, sort_keys=True, ensure_ascii=False, default=str).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8, key=seed.to_bytes(8, "little", signed=True)).digest(), "little")


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    h.update(json.dumps([tokenizer.eos_token_id, tokenizer.bos_token_id, str(getattr(tokenizer, "chat_template", ""))]).encode())
    return h.hexdigest()


def fingerprint(cfg: DataSettings, fmt: str, tokenizer, seed: int, seq2seq: bool = False) -> str:
    """Hash of source contents, tokenizer, and every setting that changes the stored tokens.
    ``seq2seq``: source -> target pairs of an encoder-decoder model (other stores keep their keys)."""
    h = hashlib.blake2b(digest_size=16)
    exclude = {"packing", "cache_dir", "num_workers", "train", "max_target_length"}
    settings = cfg.model_dump(mode="json", exclude=exclude)
    settings["train"] = [s.path for s in cfg.sources()]  # weights are applied when loading, not stored
    settings["too_long"] = cfg.too_long_for(fmt)  # the default and the same policy set by hand share a cache
    key = {"v": STORE_VERSION, "format": fmt, "seed": seed, "settings": settings}
    if seq2seq:
        key["seq2seq"] = {"v": SEQ2SEQ_VERSION, "max_target_length": cfg.target_limit()}
    if settings["too_long"] == "split":
        key["split_v"] = SPLIT_VERSION
        if isinstance(cfg.eval, float):
            key["holdout"] = "blocks"
    h.update(json.dumps(key, sort_keys=True).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    specs = [s.path for s in cfg.sources()] + ([cfg.eval] if isinstance(cfg.eval, str) else [])
    for spec in specs:
        for path in source_files(spec):
            h.update(str(path.name).encode())
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- workers

_WORKER: dict[str, Any] = {}


def _tokenize_chunk(rows: list[Row]) -> tuple[TokenizedChunk, list[str]]:
    """Render and tokenize one chunk (in a worker process, or inline). Returns bad-row messages too."""
    w = _WORKER
    seq2seq = w["max_target_length"] is not None
    render = w["renderer"].pair if seq2seq else w["renderer"]
    rendered, bad = [], []
    for row in rows:
        try:
            rendered.append(render(row))
        except DataError as e:
            bad.append(str(e))
    if seq2seq:
        return tokenize_pairs(rendered, w["tokenizer"], w["max_length"], w["max_target_length"], w["too_long"]), bad
    chunk = tokenize_rendered(rendered, w["tokenizer"], w["max_length"], w["too_long"], w["special_tokens"])
    return chunk, bad


class ChunkTokenizer:
    """Tokenizes chunks of rows in order, in forked worker processes when more than one.
    ``max_target_length``: rows become source -> target pairs (encoder-decoder), ``max_length`` the source's limit."""

    def __init__(
        self, renderer: Renderer, tokenizer, max_length: int, too_long: str, workers: int, max_target_length: int | None = None
    ):
        _WORKER.update(
            renderer=renderer,
            tokenizer=tokenizer,
            max_length=max_length,
            max_target_length=max_target_length,
            too_long=too_long,
            special_tokens=renderer.fmt != "chat",  # chat templates carry their own special tokens
        )
        self.workers, self.seq2seq = workers, max_target_length is not None
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1:
            # fork: workers inherit the loaded tokenizer instead of re-importing transformers (seconds each)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # processes, not threads, do the parallel work
            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))

    def map(self, chunks: Iterator[list[Row]]) -> Iterator[tuple[TokenizedChunk, list[str]]]:
        if self.pool is None:
            yield from (_tokenize_chunk(c) for c in chunks)
            return
        pending: deque[Future] = deque()
        for c in chunks:
            pending.append(self.pool.submit(_tokenize_chunk, c))
            if len(pending) >= 2 * self.workers:  # bounded in-flight work: bounded memory
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        _WORKER.clear()


def _chunks(rows: Iterator[Row], size: int = CHUNK_ROWS) -> Iterator[list[Row]]:
    while chunk := list(islice(rows, size)):
        yield chunk


# ---------------------------------------------------------------- building


@dataclass
class _Counts:
    rows: int = 0
    sequences: int = 0
    tokens: int = 0
    target_tokens: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    split: int = 0
    dropped_masked: int = 0
    lost_tokens: int = 0
    target_truncated: int = 0
    target_dropped_too_long: int = 0
    seq2seq: bool = False  # source -> target pairs: every stored token is an input (the encoder's or the decoder's)

    def add(self, chunk: TokenizedChunk) -> None:
        self.sequences += len(chunk.lengths)
        # inputs: all but each sequence's last token; a pair's decoder reads its target shifted behind a start token
        self.tokens += int(chunk.lengths.sum()) - (0 if self.seq2seq else len(chunk.lengths))
        if len(chunk.lengths):  # targets are learned tokens after each sequence's first
            starts = np.concatenate([[0], np.cumsum(chunk.lengths)[:-1]])
            self.target_tokens += int(chunk.learn.sum()) - int(chunk.learn[starts].sum())
        self.truncated += chunk.truncated
        self.dropped_too_long += chunk.dropped_too_long
        self.split += chunk.split
        self.dropped_masked += chunk.dropped_masked
        self.lost_tokens += chunk.lost_tokens
        self.target_truncated += chunk.target_truncated
        self.target_dropped_too_long += chunk.target_dropped_too_long


def _write_store(path: Path, rows_by_source: Iterator[Iterator[Row]], tok: ChunkTokenizer, bad: BadRows, vocab: int) -> _Counts:
    writer = StoreWriter(path, vocab)
    counts = _Counts(seq2seq=tok.seq2seq)
    for rows in rows_by_source:
        writer.start_source()

        def counted(it: Iterator[Row]) -> Iterator[Row]:
            for row in it:
                counts.rows += 1
                yield row

        for chunk, bad_messages in tok.map(_chunks(counted(rows))):
            for message in bad_messages:
                bad.report(message)
            writer.append(chunk.ids, chunk.learn, chunk.lengths, chunk.continues)
            counts.add(chunk)
    writer.close({"rows": counts.rows})
    return counts


def prepare_data(cfg: DataSettings, tokenizer, seed: int, log=print, seq2seq: bool = False) -> PreparedData:
    """Token stores for train and eval: from the cache when the fingerprint matches, else built.
    ``seq2seq``: rows as source -> target pairs for an encoder-decoder model (data/seq2seq.py)."""
    start = time.perf_counter()
    fmt = resolve_format(cfg)
    key = fingerprint(cfg, fmt, tokenizer, seed, seq2seq)
    root = (cfg.cache_dir or default_cache_dir()) / "data" / key
    hit = (root / "stats.json").is_file()
    if hit:
        log(f"data: cache hit, reusing tokens from {root}")
    else:
        log(f"data: tokenizing into {root}")
        if not publish_entry(root, lambda tmp: _build(cfg, fmt, tokenizer, seed, tmp, seq2seq)):
            log(f"data: another process finished {root.name} first; using its tokens (the same ones)")
    stats = json.loads((root / "stats.json").read_text())
    stats["prepare_s"] = time.perf_counter() - start
    stats["cache_hit"] = hit
    eval_store = TokenStore(root / "eval") if (root / "eval" / "meta.json").is_file() else None
    return PreparedData(TokenStore(root / "train"), eval_store, fmt, stats, root, hit)


def publish_entry(root: Path, build: Callable[[Path], None]) -> bool:
    """Build a cache entry in a temporary directory of this process, then rename it to ``root``.

    Parallel jobs building the same entry never share a temporary; the first rename wins and
    the others drop their copy and use the winner's (a complete entry is never replaced: the
    same fingerprint means the same tokens). Entries of other fingerprints are not waited for.
    Returns False when another process's entry was used. Leftover temporaries of builds whose
    process is gone are removed first.
    """
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root.parent, STALE_BUILD_S)
    tmp = staging_dir(root)
    tmp.mkdir()
    try:
        build(tmp)
        fsync_tree(tmp)
        if (root / "stats.json").is_file():  # another process finished while this one built
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        if root.exists():  # an entry without stats.json: damaged (a hand copy), replaced
            aside = root.parent / f".{root.name}{OLD_MARK}{process_tag()}"
            try:
                root.rename(aside)
                shutil.rmtree(aside, ignore_errors=True)
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            tmp.rename(root)
        except OSError as e:  # ENOTEMPTY / EEXIST: another process's complete entry got there first
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (root / "stats.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        fsync_dir(root.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


class _SpilledRows:
    """Held-out rows written to a JSONL file as they stream by, read back once: memory stays flat."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "w", encoding="utf-8")

    def add(self, row: Row) -> None:
        self._file.write(json.dumps([row.where, row.data], ensure_ascii=False, default=str) + "\n")

    def rows(self) -> Iterator[Row]:
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                where, data = json.loads(line)
                yield Row(data, where)
        self.path.unlink()


def _row_threshold(cfg: DataSettings, seed: int) -> int:
    """The row-hash threshold holding out ``cfg.eval`` of the training rows (pass 1: 8 bytes a row)."""
    hashes = np.fromiter((row_hash(r, seed) for _, r in train_rows(cfg, BadRows("skip"))), dtype=np.uint64)
    if len(hashes) < 2:
        raise DataError(
            f"data.eval={cfg.eval}: a held-out fraction needs at least 2 rows, found {len(hashes)}; "
            "set data.too_long: split to hold out blocks instead, give data.eval a file, or set data.eval: null"
        )
    k = min(len(hashes) - 1, max(1, round(cfg.eval * len(hashes))))
    return int(np.partition(hashes, k - 1)[k - 1])


def held_out_blocks(store: TokenStore, fraction: float, seed: int) -> np.ndarray:
    """Which sequences (blocks) of ``store`` to hold out: the ``fraction`` with the smallest seeded
    content hashes. Identical blocks hash alike, so they always land on the same side."""
    n = len(store)
    if n < 2:
        raise DataError(
            f"data.eval={fraction}: holding out a fraction of the blocks needs at least 2 blocks, found {n}; "
            "lower data.max_length, give data.eval a file, or set data.eval: null"
        )
    key = seed.to_bytes(8, "little", signed=True)
    hashes = np.empty(n, dtype=np.uint64)
    for i, j in store.slices(1 << 24):  # read in slices: bounded memory for any corpus size
        base = int(store.offsets[i])
        ids = store.read(base, int(store.offsets[j]))[0]
        for q in range(i, j):
            block = ids[store.offsets[q] - base : store.offsets[q + 1] - base].tobytes()
            hashes[q] = int.from_bytes(hashlib.blake2b(block, digest_size=8, key=key).digest(), "little")
    k = min(n - 1, max(1, round(fraction * n)))
    return hashes <= np.partition(hashes, k - 1)[k - 1]


def _build(cfg: DataSettings, fmt: str, tokenizer, seed: int, out: Path, seq2seq: bool = False) -> None:
    bad = BadRows(cfg.on_bad_row)
    renderer = Renderer(fmt, cfg.fields, tokenizer, cfg.chat_template, cfg.train_on_prompt)
    too_long = cfg.too_long_for(fmt)
    if seq2seq and fmt == "text":
        raise DataError(
            f"data.train={cfg.train!r}: text rows have no source -> target pairs for an encoder-decoder model; "
            "give prompt/completion, source/target, input/output, alpaca or chat rows"
        )
    workers = cfg.num_workers or os.cpu_count() or 1
    tok = ChunkTokenizer(renderer, tokenizer, cfg.max_length, too_long, workers, cfg.target_limit() if seq2seq else None)
    vocab = len(tokenizer)
    n_sources = len(cfg.sources())
    # a held-out fraction comes out of the rows, or, when long documents are split, out of the blocks:
    # a one-file corpus is one row but many blocks
    hold_blocks = isinstance(cfg.eval, float) and too_long == "split"
    try:
        eval_hashes: set[int] = set()
        threshold: int | None = None
        eval_counts = None
        if isinstance(cfg.eval, str):
            if next(iter_source(cfg.eval, BadRows("skip"), cfg.txt_mode), None) is None:
                raise DataError(f"data.eval={cfg.eval!r}: no rows found")
            eval_hashes = {row_hash(r, seed) for r in iter_source(cfg.eval, BadRows("skip"), cfg.txt_mode)}
            eval_counts = _write_store(out / "eval", iter([iter_source(cfg.eval, bad, cfg.txt_mode)]), tok, bad, vocab)
        elif isinstance(cfg.eval, float) and not hold_blocks:
            threshold = _row_threshold(cfg, seed)

        overlap = 0
        spill = _SpilledRows(out / "held_out.jsonl") if threshold is not None else None

        def train_side() -> Iterator[Iterator[Row]]:
            rows = train_rows(cfg, bad)
            pending = next(rows, None)
            for k in range(n_sources):

                def of_source() -> Iterator[Row]:
                    nonlocal pending, overlap
                    while pending is not None and pending[0] == k:
                        row = pending[1]
                        pending = next(rows, None)
                        h = row_hash(row, seed) if (threshold is not None or eval_hashes) else 0
                        if spill is not None and h <= threshold:
                            spill.add(row)  # identical rows share a hash: never on both sides
                        elif h in eval_hashes:
                            overlap += 1
                        else:
                            yield row

                yield of_source()

        train_counts = _write_store(out / ("all" if hold_blocks else "train"), train_side(), tok, bad, vocab)
        if spill is not None:
            eval_counts = _write_store(out / "eval", iter([spill.rows()]), tok, bad, vocab)
    finally:
        tok.close()
    if hold_blocks:
        whole = TokenStore(out / "all")
        if len(whole) == 0:
            raise _nothing_to_learn(bad)
        train_side_counts, eval_side_counts = split_store(whole, held_out_blocks(whole, cfg.eval, seed), out / "train", out / "eval", vocab)
        del whole
        shutil.rmtree(out / "all")
        for name, value in train_side_counts.items():
            setattr(train_counts, name, value)
        eval_counts = _Counts(rows=0, **eval_side_counts)
    if train_counts.sequences == 0:
        raise _nothing_to_learn(bad)
    stored = train_counts.tokens + train_counts.sequences + (eval_counts.tokens + eval_counts.sequences if eval_counts else 0)
    stats = {
        "format": fmt,
        "too_long": too_long,
        "eval_holdout": "blocks" if hold_blocks else "rows" if threshold is not None else "file" if eval_counts else "none",
        "train_rows": train_counts.rows,
        "eval_rows": eval_counts.rows if eval_counts else 0,
        "train_sequences": train_counts.sequences,
        "eval_sequences": eval_counts.sequences if eval_counts else 0,
        "train_tokens": train_counts.tokens,
        "train_target_tokens": train_counts.target_tokens,
        "truncated": train_counts.truncated,
        "dropped_too_long": train_counts.dropped_too_long,
        "lost_tokens": train_counts.lost_tokens + (eval_counts.lost_tokens if eval_counts else 0),
        "lost_token_share": (lost := train_counts.lost_tokens + (eval_counts.lost_tokens if eval_counts else 0)) / max(1, lost + stored),
        "split": train_counts.split,
        "dropped_masked": train_counts.dropped_masked,
        "eval_overlap_dropped": overlap,
        "bad_rows": bad.count,
        "bad_row_examples": bad.first,
    }
    if seq2seq:  # the target side's own limit and counts; the keys above count sources
        stats.update(
            encoder_decoder=True,
            max_target_length=cfg.target_limit(),
            target_truncated=train_counts.target_truncated,
            target_dropped_too_long=train_counts.target_dropped_too_long,
        )
    (out / "stats.json").write_text(json.dumps(stats, indent=2))


def _nothing_to_learn(bad: BadRows) -> DataError:
    return DataError(
        "no training example has a token to learn (the data is empty, or every example is fully masked"
        + (f"; {bad.count} bad rows skipped, first: {bad.first[0]}" if bad.count else "")
        + ")"
    )
