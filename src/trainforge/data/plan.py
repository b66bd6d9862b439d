"""Data planning: the tokenizer, the token stores, and the packed rows a run trains on.

Shared by ``trainforge prepare`` (no model), ``train`` and ``plan``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..rundir.atomic import atomic_write_text
from ..config.run import ModelSettings, RunConfig
from ..config.preference import OBJECTIVES_FOR_DATA
from ..stop import Interrupted, StopRequest
from ..metrics.console import ConsoleReporter
from ..model.tokenizer import bpe_tokenizer_from_json, build_char_tokenizer, load_tokenizer, train_bpe_tokenizer
from .cache import built_tokenizer_file
from .formats import ALPACA_PROMPT_WITH_INPUT, DEFAULT_CHAT_TEMPLATE
from .loader import RowCollator, TrainLoader
from .mixture import (
    add_run_epochs, check_sources_filled, describe_mixture, figures_dicts, missed_shares, mixture_figures, mixture_indices,
)
from .packing import build_rows, pair_rows
from .prepare import PreparedData, prepare_data, resolve_format, training_texts
from .source_reads import check_source_formats, read_parts
from .seq2seq import Seq2SeqCollator
from .sources import DataError
from .store import TokenStore


def get_tokenizer(cfg: RunConfig, reporter: ConsoleReporter):
    """The configured tokenizer, the model directory's, or one built from the training text:
    a character vocabulary (``model.tokenizer: char``) or a byte-level BPE.

    Built tokenizers are deterministic functions of the data: a resumed run rebuilds the same
    one (the checkpoint's vocabulary hash checks it), and ``final/`` gets a copy.
    """
    if cfg.model.tokenizer == "char":
        t = time.perf_counter()
        fmt = resolve_format(cfg.data)
        texts = training_texts(cfg.data, fmt)
        # characters the rendering adds around the data's fields: alpaca's prompt, the chat template and roles (of
        # each part read its own way: a mixture's sources)
        added = [text for part, part_fmt in read_parts(cfg.data) for text in {
            "alpaca": [ALPACA_PROMPT_WITH_INPUT], "chat": [part.chat_template or DEFAULT_CHAT_TEMPLATE, "system user assistant tool"],
        }.get(part_fmt, [])]
        tok = build_char_tokenizer(itertools.chain(texts, added))
        reporter.info(f"tokenizer: characters of the data, {len(tok)} tokens ({time.perf_counter() - t:.1f}s)")
        return tok
    source = cfg.model.tokenizer or cfg.model.path
    if source is not None:
        return load_tokenizer(source)
    t = time.perf_counter()
    fmt = resolve_format(cfg.data)
    # trained once per data and vocabulary size: later runs (and resumes) load the same tokenizer from the cache
    cached = built_tokenizer_file(cfg.data, fmt, cfg.model.tokenizer_vocab_size)
    tok = cached_bpe_tokenizer(cfg, fmt)
    if tok is not None:
        how = f"loaded from {cached.parent}"
    else:
        tok = train_bpe_tokenizer(training_texts(cfg.data, fmt), cfg.model.tokenizer_vocab_size)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cached, tok.backend_tokenizer.to_str())
        except OSError:
            pass  # a read-only cache only costs training it again next time
        how = "trained on the data"
    reporter.info(f"tokenizer: byte-level BPE {how}, {len(tok)} tokens ({time.perf_counter() - t:.1f}s)")
    return tok


def cached_bpe_tokenizer(cfg: RunConfig, fmt: str):
    """The byte-level BPE a run (or ``prepare``) trained on this data and cached; None before the first one."""
    cached = built_tokenizer_file(cfg.data, fmt, cfg.model.tokenizer_vocab_size)
    return bpe_tokenizer_from_json(cached.read_text(encoding="utf-8")) if cached.is_file() else None


@dataclass
class DataPlan:
    """Tokenized data arranged into training and eval rows."""

    prepared: PreparedData
    train_rows: list
    eval_rows: list
    collate: RowCollator | Seq2SeqCollator
    eval_collate: RowCollator | Seq2SeqCollator | None


def plan_data(cfg: RunConfig, tokenizer, reporter: ConsoleReporter, pin: bool = False,
              between_chunks: Callable[[], None] | None = None) -> DataPlan:
    """Tokenize (or reuse the cache), mix sources by weight, pack into rows. ``between_chunks``: see prepare_data.

    Encoder-decoder models (T5, BART, ...): source -> target pairs, one per row (the config
    turns packing off for them), batched by ``Seq2SeqCollator``."""
    d = cfg.data
    prepared = prepare_data(d, tokenizer, cfg.train.seed, log=reporter.info, seq2seq=cfg.model.kind.encoder_decoder,
                            between_chunks=between_chunks)
    if (warning := lost_tokens_warning(prepared.stats, d.max_length)) is not None:
        reporter.warn(warning)
    collator = collator_for(cfg, tokenizer)
    specs = d.sources()
    check_sources_filled(prepared.train, specs)
    paired = cfg.train.objective != "sft"  # rows_for reads pairs by their even index
    index = mixture_indices(prepared.train, specs, cfg.train.seed, paired)
    if len(specs) > 1:  # per source: what it holds and what an epoch of the mixture takes (summary.json: data.sources)
        formats = prepared.stats.get("source_formats") or [prepared.format] * len(specs)
        prepared.stats["sources"] = figures_dicts(mixture_figures(prepared.train, specs, index, paired, formats))
        for line in describe_mixture(prepared.stats["sources"]):
            reporter.info(line)
        for line in missed_shares(prepared.stats["sources"]):
            reporter.warn(line)
    rows = rows_for(cfg, prepared)
    train_rows = rows(prepared.train, index)
    eval_rows, eval_collate = [], None
    if prepared.eval is not None and len(prepared.eval):
        eval_rows = rows(prepared.eval, np.arange(len(prepared.eval)))
        eval_collate = collator(prepared.eval)
    return DataPlan(prepared, train_rows, eval_rows, collator(prepared.train, pin), eval_collate)


def note_run_epochs(data_stats: dict[str, Any], rows_per_epoch: int, rows_over_run: int, reporter: ConsoleReporter) -> None:
    """A mixture's epochs over the run, per source (``data_stats["sources"]``: summary.json), said on the console."""
    if "sources" in data_stats:
        add_run_epochs(data_stats["sources"], rows_per_epoch, rows_over_run)
        reporter.info("mixture over the run: " + ", ".join(f"{f['name']} {f['epochs']:.2f} epochs" for f in data_stats["sources"]))


def check_objective_data(cfg: RunConfig, fmt: str | None = None) -> None:
    """``DataError`` when ``train.objective`` and the data's format ``fmt`` (default: the first row's) disagree: a
    preference objective on other data, or preference data without one. Checked before anything is tokenized."""
    d, objective = cfg.data, cfg.train.objective
    if objective == "grpo":  # prompt rows, read by rl/prompts.py
        return
    check_source_formats(d)  # a mixture's sources: each read its way, of one kind (SFT, pairs or KTO rows)
    fmt = fmt or resolve_format(d)
    wanted = {"sft": None, "kto": "unpaired"}.get(objective, "preference")
    held = fmt if fmt in ("preference", "unpaired") else None
    if wanted == held:
        return
    n = d.fields
    layouts = {"preference": f"{{{n.prompt}, {n.chosen}, {n.rejected}}} or {{{n.chosen}, {n.rejected}}}",
               "unpaired": f"{{{n.prompt}, {n.completion}, {n.label}}} or {{{n.messages}, {n.label}}}"}
    if wanted is None:
        if held == "preference":
            sft = ("to learn the chosen replies as targets: data.format: prompt_completion and data.fields: "
                   f"{{completion: {n.chosen}}} (string pairs), or data.format: chat and data.fields: {{messages: {n.chosen}}} "
                   f"(full conversations, as UltraFeedback's; data.format: chat alone where the rows also hold {n.messages!r})")
        else:  # a label is no reason to refuse SFT: the rows read as chat or prompt/completion rows, label left unread
            sft = (f"to learn every row's reply as a target, whatever its {n.label!r}: {d.setting('data.format', 'chat')} "
                   f"({{{n.messages}, {n.label}}} rows) or "
                   f"{d.setting('data.format', 'prompt_completion')} ({{{n.prompt}, {n.completion}, {n.label}}} string rows)")
        if cfg.model.kind.encoder_decoder:  # setting the objective would be refused: none trains an encoder-decoder
            raise DataError(f"{d.source_label()} holds {held} rows ({layouts[held]}): the preference objectives train "
                            f"decoder-only models here, and this model is an encoder-decoder (source -> target rows)"
                            + f"; {sft}")
        raise DataError(f"{d.source_label()} holds {held} rows ({layouts[held]}): {d.objective_hint(*OBJECTIVES_FOR_DATA[held])}"
                        + f"; or, for SFT, {sft}")
    if held is not None:  # the other kind of preference rows: the objective is what to change
        split = (f"; or, for KTO on the pairs, {d.setting('data.format', 'unpaired')} (each chosen reply a desirable "
                 "example, each rejected one an undesirable one, as TRL's KTOTrainer reads pairs)" if held == "preference" else "")
        raise DataError(f"train.objective={objective} needs {wanted} rows ({layouts[wanted]}), but {d.source_label()} "
                        f"holds {held} rows ({layouts[held]}): {d.objective_hint(*OBJECTIVES_FOR_DATA[held])}{split}")
    told = (f" (told apart by a {n.label!r} of true or false, not 1/0 or a string: set {d.setting('data.format', 'unpaired')} "
            "to have each row's label checked)" if wanted == "unpaired" else "")
    other = (" (other column names: map them with data.fields, e.g. "
             "data.fields: {prompt: question, chosen: response_j, rejected: response_k})" if wanted == "preference" else "")
    raise DataError(f"train.objective={objective} needs {wanted} rows ({layouts[wanted]}), but {d.source_label()} "
                    f"is {fmt} data{told}{other}")


def rows_for(cfg: RunConfig, prepared: PreparedData) -> Callable[[TokenStore, np.ndarray], list]:
    """A function (store, sequence indices) -> the rows the run trains on: packed, concatenated or one per row as
    ``data.packing`` says; preference data as whole pairs (each sequence pair k = 2k, 2k + 1 in one row).
    A preference objective on other data, or preference data without one, is a ``DataError``."""
    d, objective = cfg.data, cfg.train.objective
    check_objective_data(cfg, prepared.format)
    if objective != "sft":  # a stored pair is sequences 2k and 2k + 1; a source's weight repeats or samples pairs
        return lambda store, index: pair_rows(store, index[index % 2 == 0] // 2, d.max_length)
    return lambda store, index: build_rows(store, index, d.packing, d.max_length)


def collator_for(cfg: RunConfig, tokenizer, model: ModelSettings | None = None) -> Callable[..., RowCollator | Seq2SeqCollator]:
    """A function (store, pin=False) -> the collator batching rows of ``cfg``'s data: ``Seq2SeqCollator``
    for an encoder-decoder (its decoder's start token from ``model``, default ``cfg.model``), else
    ``RowCollator``. Training and ``trainforge eval`` batch alike through it."""
    d = cfg.data
    if cfg.model.kind.encoder_decoder:
        from ..model.load import decoder_start_token_id

        start = decoder_start_token_id(model or cfg.model, tokenizer)
        return lambda store, pin=False: Seq2SeqCollator(store, tokenizer.pad_token_id, start, d.max_length, pin)
    return lambda store, pin=False: RowCollator(store, tokenizer.pad_token_id, d.packing, d.max_length, pin=pin)


PREPARE_STOPPING = "stopping: tokenizing stops at its next chunk of rows and caches nothing (send it again to stop at once)"
"""What ``trainforge prepare`` says on a first SIGTERM/SIGINT (``StopRequest``'s ``doing``)."""


def prepare_only(cfg: RunConfig, reporter: ConsoleReporter | None = None, stop: StopRequest | None = None) -> dict[str, Any]:
    """``trainforge prepare``: tokenizer, token cache and packing, with the statistics; no model.
    ``stop``: a signal it caught stops the tokenizing at its next chunk, nothing cached (``Interrupted``)."""
    reporter = reporter or ConsoleReporter()

    def stop_if_asked() -> None:
        if stop is not None and stop.requested:
            raise Interrupted(f"{stop.name} while preparing the data: stopped before the token cache entry was "
                              "complete; run the same command again to prepare the data (a corpus of many files goes on from the files "
                              "it finished)", stop.name)

    check_objective_data(cfg)  # from the first row: refused before a tokenizer is trained or anything tokenized
    tokenizer = get_tokenizer(cfg, reporter)
    from ..engine.packing_check import settle_packing

    cfg = settle_packing(cfg, tokenizer, None, reporter.info)  # rows as the run will build them (engine/packing_check)
    stop_if_asked()
    plan = plan_data(cfg, tokenizer, reporter, between_chunks=stop_if_asked)
    loader = TrainLoader(plan.train_rows, plan.collate, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.packing is False)
    efficiency = loader.padding_efficiency()
    reporter.info(describe_data(plan, efficiency))
    stats = {**plan.prepared.stats, "rows": len(plan.train_rows), "row_efficiency": efficiency}
    how = "reused" if plan.prepared.cache_hit else f"prepared in {stats['prepare_s']:.1f}s"
    reporter.info(f"cache: {plan.prepared.cache_path} ({how})")
    return stats


# share of the data's tokens that truncation (or too_long: drop) may discard before the console says so
LOST_TOKENS_WARN = 0.03


def lost_tokens_warning(stats: dict[str, Any], max_length: int) -> str | None:
    """A console line when more than ``LOST_TOKENS_WARN`` of the tokens were cut off or dropped."""
    if stats.get("lost_token_share", 0.0) <= LOST_TOKENS_WARN:
        return None
    how = "truncation" if "truncate" in str(stats.get("too_long")).split("+") else "dropping too-long examples"
    fix = (
        "set data.too_long: split to keep long documents as consecutive blocks"
        if stats["format"] == "text"
        else "raise data.max_length if the model's context allows it"
    )
    limits = f"data.max_length={max_length}"
    if stats.get("encoder_decoder"):
        limits += f" (sources) and data.max_target_length={stats['max_target_length']} (targets)"
        fix = "raise data.max_length or data.max_target_length if the model allows it"
    return (
        f"data: {how} at {limits} discarded {stats['lost_tokens']:,} tokens, "
        f"{stats['lost_token_share']:.0%} of the data; {fix}"
    )


def describe_data(plan: DataPlan, efficiency: float) -> str:
    s = plan.prepared.stats
    mode = {True: "packed", False: "unpacked", "concat": "concatenated"}[plan.collate.packed or ("concat" if plan.collate.concat else False)]
    if s.get("encoder_decoder"):
        mode = "source -> target"
    # a pair is counted in sequences where it is cut (each side) and in pairs where it is dropped (whole)
    unit = {"preference": ("sides ", "pairs "), "unpaired": ("sequences ", "examples ")}.get(s["format"], ("", ""))
    notes = [
        f"{s[k]:,} {label}"
        for k, label in (
            ("truncated", "source truncated" if s.get("encoder_decoder") else unit[0] + "truncated"),
            ("target_truncated", "target truncated"),
            ("split", "split into blocks"),
            ("dropped_too_long", "dropped for a too-long source" if s.get("encoder_decoder") else "dropped as too long"),
            ("target_dropped_too_long", "dropped for a too-long target"),
            ("dropped_masked", unit[1] + "dropped with nothing to learn"),
            ("bad_rows", "bad rows skipped"),
            ("eval_overlap_dropped", "dropped as duplicates of eval rows"),
        )
        if s.get(k)
    ]
    return (
        f"data: {s['format']}, {s['train_rows']:,} train rows{_examples(s)} -> {s['train_sequences']:,} sequences "
        f"({s['train_tokens']:,} tokens)" + {"preference": " in pairs", "unpaired": " with their KL samples"}.get(s["format"], "")
        + f" -> {len(plan.train_rows):,} {mode} rows, "
        f"{efficiency:.1%} of row capacity is real tokens; "
        + _eval_part(s)
        + ("; " + ", ".join(notes) if notes else "")
        + (f"\n  bad rows, first: {'; '.join(s['bad_row_examples'])}" if s.get("bad_row_examples") else "")
    )


def _eval_part(s: dict) -> str:
    """``eval 12 rows``, ``eval 40 blocks held out``, or a mixture's held-out sequences where its sources hold out
    rows (chat) and blocks (split text) alike."""
    kind = s.get("eval_holdout")
    if kind == "blocks":
        return f"eval {s['eval_sequences']:,} blocks held out"
    if kind is not None and "+" in kind:
        return f"eval {s['eval_sequences']:,} sequences held out (rows or blocks of each source)"
    return f"eval {s['eval_rows']:,} row{'' if s['eval_rows'] == 1 else 's'}"


def _examples(s: dict) -> str:
    """`` (570 examples)`` where KTO's examples are not the rows (pairs split in two, bad rows skipped)."""
    if s["format"] != "unpaired":
        return ""
    examples = s["train_sequences"] // 2 + s.get("dropped_masked", 0)  # stored with its KL sample, or dropped whole
    return f" ({examples:,} examples)" if examples != s["train_rows"] else ""
