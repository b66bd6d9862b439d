"""Tokenize once: rows -> the train and eval token stores of a cache entry, from the cache when it holds them.

Rows are streamed in chunks and tokenized by worker processes; memory is bounded by the
chunk size and the number of chunks in flight, not by the dataset. The entry's key and its
publishing: ``data/cache.py``; which rows or blocks become the eval set: ``data/holdout.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ..config.data import DataSettings, FieldNames
from .cache import STATS_FILE, cache_entry, is_complete, publish_entry, source_entries
from .mixture_cache import join_entries
from .chat_messages import SHAREGPT_FIELD
from .chat_tools import row_tools
from .formats import Renderer, TokenizedChunk, chat_messages, format_fields, tokenize_rendered
from .preference import PreferenceRenderer
from .preference import tokenize_pairs as tokenize_preference_pairs
from .preference import tokenize_unpaired
from .holdout import RowHoldout, holdout_kind, split_off_blocks
from .source_reads import per_source_entries, read_parts, resolve_format, shared_settings, source_formats, source_settings, train_rows
from .sources import BadRows, DataError, Row, iter_source
from .seq2seq import tokenize_pairs
from .shards import ShardStage, shard_units, units_dir
from .store import StoreWriter, TokenStore
from .workers import WorkerDied, stop_pool, worker_pool

CHUNK_ROWS = 1024


@dataclass
class PreparedData:
    train: TokenStore
    eval: TokenStore | None
    format: str
    stats: dict[str, Any]
    cache_path: Path
    cache_hit: bool


def training_texts(cfg: DataSettings, fmt: str) -> Iterator[str]:
    """The training text, for training a tokenizer on (every string field the format reads); ``fmt``: the format
    of data read one way (a mixture's sources are read each with its own settings and format)."""
    for part, part_fmt in read_parts(cfg) if per_source_entries(cfg) else [(shared_settings(cfg), fmt)]:
        yield from _part_texts(part, part_fmt)


def _part_texts(cfg: DataSettings, fmt: str) -> Iterator[str]:
    """``training_texts`` of data read one way."""
    keys = format_fields(fmt, cfg.fields) + ((cfg.fields.input,) if fmt == "alpaca" else ())
    for _, row in train_rows(cfg, BadRows("skip")):
        if fmt == "chat":  # the contents of the turns, in either message layout, and the tools they call
            try:
                messages = chat_messages(row, cfg.fields, "tool")[0]
                yield from (m["content"] for m in messages)
                yield from (json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls"))
                if tools := row_tools(row):
                    yield json.dumps(tools, ensure_ascii=False)  # as templates write them (tojson keeps non-ASCII)
            except DataError:
                pass  # reported with its location when the data is tokenized
            continue
        for key in keys:
            value = row.data.get(key)
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):  # preference sides as message lists
                yield from (m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))
        if fmt in ("preference", "unpaired") and isinstance(row.data.get(cfg.fields.chosen), dict):
            yield from single_message_texts(row, cfg.fields)
        elif fmt == "unpaired" and cfg.fields.messages not in row.data and isinstance(row.data.get(SHAREGPT_FIELD), list):
            yield from single_message_texts(row, cfg.fields)


def single_message_texts(row: Row, names: FieldNames) -> Iterator[str]:
    """The texts of a LLaMA-Factory row: its ``messages`` or ShareGPT ``conversations`` turns, a top-level ``system``, and
    each single-message side (``{"from", "value"}`` or ``{"role", "content"}``)."""
    turns = row.data.get(names.messages, row.data.get(SHAREGPT_FIELD))
    messages = [m for m in turns if isinstance(m, dict)] if isinstance(turns, list) else []
    messages += [row.data[k] for k in (names.chosen, names.rejected) if isinstance(row.data.get(k), dict)]
    for m in messages:
        content = m.get("content", m.get("value"))
        if isinstance(content, str):
            yield content
    if isinstance(row.data.get("system"), str):
        yield row.data["system"]


# ---------------------------------------------------------------- workers

_WORKER: dict[str, Any] = {}


def _tokenize_chunk(rows: list[Row]) -> tuple[TokenizedChunk, list[str]]:
    """Render and tokenize one chunk (in a worker process, or inline). Returns bad-row messages too."""
    w = _WORKER
    seq2seq = w["max_target_length"] is not None
    fmt = w["renderer"].fmt
    if seq2seq:
        render = w["renderer"].pair
    elif fmt in ("preference", "unpaired"):  # a pair of replies, or KTO completions with their labels
        preference = PreferenceRenderer(w["renderer"])
        render = preference.pair if fmt == "preference" else preference.examples
    else:
        render = w["renderer"]
    rendered, bad = [], []
    for row in rows:
        try:
            item = render(row)
            rendered.extend(item) if fmt == "unpaired" else rendered.append(item)  # a split pair is two KTO examples
        except DataError as e:
            bad.append(str(e))
    if fmt == "preference":  # each pair as two sequences, chosen then rejected (packing.pair_rows keeps them together)
        return tokenize_preference_pairs(rendered, w["tokenizer"], w["max_length"]), bad
    if fmt == "unpaired":  # each example with its KL sample (its prompt, another row's completion), as a pair
        return tokenize_unpaired(rendered, w["tokenizer"], w["max_length"]), bad
    if seq2seq:
        return tokenize_pairs(rendered, w["tokenizer"], w["max_length"], w["max_target_length"], w["too_long"]), bad
    chunk = tokenize_rendered(rendered, w["tokenizer"], w["max_length"], w["too_long"], w["special_tokens"])
    return chunk, bad


class ChunkTokenizer:
    """Tokenizes chunks of rows in order, in forked worker processes when more than one.
    ``max_target_length``: rows become source -> target pairs (encoder-decoder), ``max_length`` the source's limit."""

    def __init__(
        self, renderer: Renderer, tokenizer, max_length: int, too_long: str, workers: int, max_target_length: int | None = None,
        between_chunks: Callable[[], None] | None = None,
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
        self.between_chunks = between_chunks or (lambda: None)  # may raise to stop (a signal): checked per chunk
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1:
            # fork: workers inherit the loaded tokenizer instead of re-importing transformers (seconds each);
            # they leave signals to this process and die with it (data/workers.py)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # processes, not threads, do the parallel work
            self.pool = worker_pool(workers)

    def map(self, chunks: Iterator[list[Row]]) -> Iterator[tuple[TokenizedChunk, list[str]]]:
        if self.pool is None:
            for c in chunks:
                self.between_chunks()
                yield _tokenize_chunk(c)
            return
        pending: deque[Future] = deque()
        try:
            for c in chunks:
                self.between_chunks()
                pending.append(self.pool.submit(_tokenize_chunk, c))
                if len(pending) >= 2 * self.workers:  # bounded in-flight work: bounded memory
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            self.between_chunks()  # the workers got the stop signal too (sent to the process group): stop as asked
            raise WorkerDied(
                f"a tokenizer worker process died while tokenizing ({self.workers} workers; killed by the system, most "
                "likely its out-of-memory killer): lower data.num_workers (each holds chunks of rows and their tokens), "
                "or free memory; nothing was cached, the same command tokenizes again"
            ) from None

    def close(self, abort: bool = False) -> None:
        """Shut the workers down: after the work they hold, or (``abort``: a stop, an error) at once."""
        if self.pool is not None:
            stop_pool(self.pool) if abort else self.pool.shutdown()
            self.pool = None
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
    token_squares: int = 0  # sum of each sequence's input tokens squared: attention's cost on packed rows
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
        inputs = chunk.lengths.astype(np.int64) - (0 if self.seq2seq else 1)
        self.tokens += int(inputs.sum())
        self.token_squares += int((inputs * inputs).sum())
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

    def merge(self, part: dict[str, Any]) -> None:
        """Add the counts of a shard (``asdict`` of another ``_Counts``)."""
        for name, value in part.items():
            if name != "seq2seq":
                setattr(self, name, getattr(self, name) + int(value))


def _write_store(path: Path, rows_by_source: Iterator[Iterator[Row]], tok: ChunkTokenizer, bad: BadRows, vocab: int) -> _Counts:
    writer = StoreWriter(path, vocab)
    counts = _Counts(seq2seq=tok.seq2seq)
    for rows in rows_by_source:
        writer.start_source()
        _write_rows(rows, writer, tok, bad, counts)
    writer.close({"rows": counts.rows})
    return counts


def _write_rows(rows: Iterator[Row], writer: StoreWriter, tok: ChunkTokenizer, bad: BadRows, counts: _Counts) -> None:
    """Tokenize ``rows`` in chunks onto ``writer``, counting them into ``counts``."""

    def counted(it: Iterator[Row]) -> Iterator[Row]:
        for row in it:
            counts.rows += 1
            yield row

    for chunk, bad_messages in tok.map(_chunks(counted(rows))):
        for message in bad_messages:
            bad.report(message)
        writer.append(chunk.ids, chunk.learn, chunk.lengths, chunk.continues, chunk.desirable)
        counts.add(chunk)


def _write_shards(stage: ShardStage, path: Path, tok: ChunkTokenizer, bad: BadRows, vocab: int, cfg: DataSettings,
                  holdout: RowHoldout) -> _Counts:
    """The training store at ``path``, tokenized file by file, each finished file kept for a resume (data/shards.py)."""

    def tokenize(rows: Iterator[Row], writer: StoreWriter, part: BadRows) -> dict[str, Any]:
        counts = _Counts(seq2seq=tok.seq2seq)
        _write_rows(rows, writer, tok, part, counts)
        return asdict(counts)

    keep = holdout.keep if holdout.spill is not None or holdout.eval_hashes else None  # else it keeps every row
    total = _Counts(seq2seq=tok.seq2seq)
    for part in stage.write(path, vocab, len(cfg.sources()), tokenize, bad, cfg.txt_mode, keep):
        total.merge(part)
    return total


def prepare_data(cfg: DataSettings, tokenizer, seed: int, log=print, seq2seq: bool = False,
                 between_chunks: Callable[[], None] | None = None) -> PreparedData:
    """Token stores for train and eval: from the cache when the fingerprint matches, else built.
    ``seq2seq``: rows as source -> target pairs for an encoder-decoder model (data/seq2seq.py).
    ``between_chunks``: called before each chunk is tokenized; what it raises stops the build (nothing is cached)."""
    start = time.perf_counter()
    fmt = resolve_format(cfg)
    root = cache_entry(cfg, fmt, tokenizer, seed, seq2seq)
    hit = is_complete(root)
    if hit:
        log(f"data: cache hit, reusing tokens from {root}")
    elif per_source_entries(cfg):  # a mixture: an entry per source, tokenized only where missing, then joined
        roots, formats = source_entries(cfg, tokenizer, seed, seq2seq), source_formats(cfg)
        for k, sub in enumerate(roots):  # each source read with its own settings and format
            _publish(source_settings(cfg, k, formats), formats[k], tokenizer, seed, sub, seq2seq, between_chunks, log, k)
        log(f"data: joining {len(roots)} sources into {root}")
        publish_entry(root, lambda tmp: join_entries(roots, tmp))
    else:
        _publish(shared_settings(cfg), fmt, tokenizer, seed, root, seq2seq, between_chunks, log)
    stats = json.loads((root / STATS_FILE).read_text())
    stats["prepare_s"] = time.perf_counter() - start
    stats["cache_hit"] = hit
    eval_store = TokenStore(root / "eval") if (root / "eval" / "meta.json").is_file() else None
    return PreparedData(TokenStore(root / "train"), eval_store, fmt, stats, root, hit)


def _publish(cfg: DataSettings, fmt: str, tokenizer, seed: int, root: Path, seq2seq: bool,
             between_chunks: Callable[[], None] | None, log, source: int | None = None) -> None:
    """Tokenize into the entry ``root`` unless it is complete; ``source``: the k-th source of a mixture (named in
    what is said, and in its errors)."""
    named = "" if source is None else f"source {source} ({cfg.sources()[0].path}) "
    if is_complete(root):
        log(f"data: {named}cache hit, reusing tokens from {root}")
        shutil.rmtree(units_dir(root), ignore_errors=True)  # shards a prepare killed after publishing left
        return
    log(f"data: tokenizing {named}into {root}")
    try:
        if not publish_entry(root, lambda tmp: _build(cfg, fmt, tokenizer, seed, tmp, seq2seq, between_chunks, root, log)):
            log(f"data: another process finished {root.name} first; using its tokens (the same ones)")
    except DataError as e:
        if source is None:
            raise
        raise DataError(f"data.train[{source}] ({cfg.sources()[0].path!r}): {e}") from None
    except OSError:
        if not is_complete(root):
            raise
        # another prepare of this entry published it and removed the shards this one was joining: its tokens serve
        log(f"data: another process finished {root.name} first; using its tokens (the same ones)")
    shutil.rmtree(units_dir(root), ignore_errors=True)  # the entry is published: its shards are no longer needed


def _build(cfg: DataSettings, fmt: str, tokenizer, seed: int, out: Path, seq2seq: bool = False,
           between_chunks: Callable[[], None] | None = None, root: Path | None = None, log=print) -> None:
    """Tokenize into ``out``; ``root``: the entry it becomes, where finished shards wait for a resume (None: one stream)."""
    bad = BadRows(cfg.on_bad_row)
    renderer = Renderer(fmt, cfg.fields, tokenizer, cfg.chat_template, cfg.train_on_prompt)
    too_long = cfg.too_long_for(fmt)
    if seq2seq and fmt == "text":
        raise DataError(
            f"{cfg.source_label()}: text rows have no source -> target pairs for an encoder-decoder model; "
            "give prompt/completion, source/target, input/output, alpaca or chat rows"
        )
    workers = cfg.num_workers or os.cpu_count() or 1
    tok = ChunkTokenizer(renderer, tokenizer, cfg.max_length, too_long, workers, cfg.target_limit() if seq2seq else None, between_chunks)
    vocab = len(tokenizer)
    n_sources = len(cfg.sources())
    kind = holdout_kind(cfg.eval, too_long)
    try:
        eval_counts = None
        holdout = RowHoldout(seed)
        if kind == "file":
            holdout = RowHoldout.of_file(cfg.eval, seed, cfg.txt_mode)
            if cfg.eval_file_tokens:  # else a mixture's source read otherwise than the file: its rows dropped only
                eval_counts = _write_store(out / "eval", iter([iter_source(cfg.eval, bad, cfg.txt_mode)]), tok, bad, vocab)
        elif kind == "rows":
            first_pass = (r for _, r in train_rows(cfg, BadRows("skip")))
            holdout = RowHoldout.of_fraction(first_pass, cfg.eval, seed, out / "held_out.jsonl")

        def train_side() -> Iterator[Iterator[Row]]:
            rows = train_rows(cfg, bad)
            pending = next(rows, None)
            for k in range(n_sources):

                def of_source() -> Iterator[Row]:
                    nonlocal pending
                    while pending is not None and pending[0] == k:
                        row = pending[1]
                        pending = next(rows, None)
                        if holdout.keep(row, k):
                            yield row

                yield of_source()

        train_dir = out / ("all" if kind == "blocks" else "train")
        units = shard_units(cfg, fmt) if root is not None else None
        if units:
            train_counts = _write_shards(ShardStage(root, units, log), train_dir, tok, bad, vocab, cfg, holdout)
        else:
            train_counts = _write_store(train_dir, train_side(), tok, bad, vocab)
        if kind == "rows":
            eval_counts = _write_store(out / "eval", holdout.held_out(n_sources), tok, bad, vocab)
    except BaseException:  # a stop or an error: the workers' remaining chunks would be thrown away
        tok.close(abort=True)
        raise
    tok.close()
    if kind == "blocks":
        if train_counts.sequences == 0:
            raise _nothing_to_learn(bad, train_counts, cfg, fmt)
        train_side_counts, eval_side_counts = split_off_blocks(out / "all", cfg.eval, seed, out / "train", out / "eval", vocab)
        for name, value in train_side_counts.items():
            setattr(train_counts, name, value)
        eval_counts = _Counts(rows=0, **eval_side_counts)
    if train_counts.sequences == 0:
        raise _nothing_to_learn(bad, train_counts, cfg, fmt)
    stored = train_counts.tokens + train_counts.sequences + (eval_counts.tokens + eval_counts.sequences if eval_counts else 0)
    stats = {
        "format": fmt,
        "too_long": too_long,
        "eval_holdout": kind,
        "train_rows": train_counts.rows,
        "eval_rows": eval_counts.rows if eval_counts else 0,
        "train_sequences": train_counts.sequences,
        "eval_sequences": eval_counts.sequences if eval_counts else 0,
        "train_tokens": train_counts.tokens,
        "train_token_squares": train_counts.token_squares,
        "train_target_tokens": train_counts.target_tokens,
        "truncated": train_counts.truncated,
        "dropped_too_long": train_counts.dropped_too_long,
        "lost_tokens": train_counts.lost_tokens + (eval_counts.lost_tokens if eval_counts else 0),
        "lost_token_share": (lost := train_counts.lost_tokens + (eval_counts.lost_tokens if eval_counts else 0)) / max(1, lost + stored),
        "split": train_counts.split,
        "dropped_masked": train_counts.dropped_masked,
        "eval_overlap_dropped": holdout.overlap,
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
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2))  # last: it marks the entry complete


def _nothing_to_learn(bad: BadRows, counts: _Counts, cfg: DataSettings, fmt: str) -> DataError:
    """No example left with a token to learn: say why, from the counts (an empty source, bad rows, or every
    example's learned tokens cut off at data.max_length) and what to change."""
    why = []
    if counts.dropped_masked:
        pairs = fmt == "preference"
        why.append(
            f"all {counts.dropped_masked:,} examples lost every learned token to data.max_length {cfg.max_length} "
            + (f"(both sides of a pair share a row: each keeps its first {cfg.max_length // 2 + 1} tokens, prompt first)"
               if pairs else "(the prompt fills the row before the reply starts)")
            + "; raise data.max_length or shorten the prompts"
        )
    if counts.dropped_too_long:
        why.append(f"{counts.dropped_too_long:,} examples longer than data.max_length {cfg.max_length} were dropped "
                   "(data.too_long: drop); raise data.max_length or use truncate")
    if bad.count:
        why.append(f"{bad.count} bad rows skipped, first: {bad.first[0]}")
    return DataError(
        "no training example has a token to learn: "
        + ("; ".join(why) if why else "the data is empty, or every example is fully masked (no reply tokens to learn)")
    )
