"""The token cache: an entry's key (a fingerprint of everything that changes the stored tokens), its place, and publishing it.

An entry is a directory ``CACHE/data/KEY`` holding the train (and eval) token stores and
``stats.json``, which is written last: an entry with ``stats.json`` is complete. Entries are
published once through the project's atomic protocol (``atomic.publish_dir``): parallel jobs
building the same entry never share a temporary, the first complete entry wins and is never
replaced (the same key means the same tokens), the others use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..rundir.atomic import publish_dir, remove_stale_temps
from ..config.data import DataSettings, FieldNames, default_cache_dir
from ..errors import TrainforgeError
from .formats import DEFAULT_CHAT_TEMPLATE
from .holdout import holdout_kind
from .source_reads import format_parts, per_source_entries, shared_settings, source_formats, source_settings
from .sources import BUILTIN_ROWS_VERSION, BUILTIN_SOURCES, source_files

STORE_VERSION = 1  # bump when the store layout or tokenization rules change
SEQ2SEQ_VERSION = 1  # source -> target stores of encoder-decoder models (data/seq2seq.py): a key of their own
KL_SAMPLE_VERSION = 2  # KTO's KL samples (data/preference.py kl_partners; 2: never a completion of the same prompt)
# messages rendered with a chat template (chat rows, and preference/KTO rows of messages): a key of its own, so
# text, prompt/completion and alpaca stores keep theirs (2: a row's tools are rendered, call arguments are JSON
# objects, function_call turns are calls, weight 0 turns are not learned, rows with dropped messages are refused)
CHAT_VERSION = 2
PREFERENCE_VERSION = 4  # pairs tokenized as two sequences (data/preference.py): bump when that changes (3: a prompt both sides begin with is written once; 4: string pairs split after their last Assistant: marker, a prompt string before reply-only lists)
# too_long: split stores mark split continuations (continues.npy) from version 2 on; a key of its
# own, so the stores (and checkpoints' store keys) of every other setting stay valid
SPLIT_VERSION = 2
# a build temporary of another host is left over (its process gone) when nothing in it changed for
# this long; on this host a build whose process no longer runs is removed at once
STALE_BUILD_S = 2 * 3600
STATS_FILE = "stats.json"  # written last: its presence marks a complete entry


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer.get_vocab()).encode())
    h.update(json.dumps([tokenizer.eos_token_id, tokenizer.bos_token_id, str(getattr(tokenizer, "chat_template", ""))]).encode())
    return h.hexdigest()


# data.fields names added after stores were first keyed: left out of a key while at their default, so the
# stores (and the checkpoints that name them) of runs that do not rename them keep their keys
LATER_FIELD_NAMES = ("chosen", "rejected", "label")


def _settings(cfg: DataSettings, exclude: set[str]) -> dict[str, Any]:
    """The data settings a key hashes, as JSON."""
    settings = cfg.model_dump(mode="json", exclude=exclude)
    default = FieldNames()
    for name in LATER_FIELD_NAMES:
        if getattr(cfg.fields, name) == getattr(default, name):
            del settings["fields"][name]
    return settings


def fingerprint(cfg: DataSettings, fmt: str, tokenizer, seed: int, seq2seq: bool = False) -> str:
    """Hash of source contents, tokenizer, and every setting that changes the stored tokens.
    ``seq2seq``: source -> target pairs of an encoder-decoder model (other stores keep their keys)."""
    h = hashlib.blake2b(digest_size=16)
    exclude = {"packing", "cache_dir", "num_workers", "train", "max_target_length"}
    settings = _settings(cfg, exclude)
    settings["train"] = [s.path for s in cfg.sources()]  # weights are applied when loading, not stored
    settings["too_long"] = cfg.too_long_for(fmt)  # the default and the same policy set by hand share a cache
    key = {"v": STORE_VERSION, "format": fmt, "seed": seed, "settings": settings}
    if fmt in ("preference", "unpaired"):
        key["preference_v"] = PREFERENCE_VERSION
    if fmt == "unpaired":
        key["kl_v"] = KL_SAMPLE_VERSION
    if fmt in ("chat", "preference", "unpaired"):
        key["chat_v"] = CHAT_VERSION
        if not cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            # messages render with trainforge's own default template here: an edit of it changes the stored tokens
            key["default_chat_template"] = hashlib.blake2b(DEFAULT_CHAT_TEMPLATE.encode(), digest_size=8).hexdigest()
    if seq2seq:
        key["seq2seq"] = {"v": SEQ2SEQ_VERSION, "max_target_length": cfg.target_limit()}
    if isinstance(cfg.eval, str) and not cfg.eval_file_tokens:  # a mixture's source read otherwise than the first
        key["eval_file_tokens"] = False
    if settings["too_long"] == "split":
        key["split_v"] = SPLIT_VERSION
        if holdout_kind(cfg.eval, settings["too_long"]) == "blocks":
            key["holdout"] = "blocks"
    h.update(json.dumps(key, sort_keys=True).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    _hash_sources(h, [s.path for s in cfg.sources()] + ([cfg.eval] if isinstance(cfg.eval, str) else []))
    return h.hexdigest()


BPE_VERSION = 1  # bump when train_bpe_tokenizer builds differently
CHAT_TEXTS_VERSION = 2  # what a chat tokenizer trains on (prepare.training_texts; 2: tool calls and definitions too)


def built_tokenizer_key(cfg: DataSettings, fmt: str, vocab_size: int) -> str:
    """Hash of what a tokenizer trained on the data depends on: the training sources' contents, the data
    settings and format that pick its texts, the vocabulary size and the tokenizers library."""
    import tokenizers

    h = hashlib.blake2b(digest_size=16)
    settings = _settings(cfg, {"cache_dir", "num_workers"})
    if isinstance(cfg.train, list):  # a mixture's shares, weights and names pick no text: changing them trains nothing again
        # a source's own format, fields or template do (the texts of the fields it reads, its template's)
        settings["train"] = [{"path": s.path, **s.model_dump(mode="json", include={"format", "fields", "chat_template"})}
                             if s.read_keys() else s.path for s in cfg.sources()]
    key = {"v": BPE_VERSION, "tokenizers": tokenizers.__version__, "format": fmt, "vocab": vocab_size, "settings": settings}
    if "chat" in format_parts(fmt):
        key["chat_texts_v"] = CHAT_TEXTS_VERSION
    h.update(json.dumps(key, sort_keys=True).encode())
    _hash_sources(h, [s.path for s in cfg.sources()])
    return h.hexdigest()


def built_tokenizer_file(cfg: DataSettings, fmt: str, vocab_size: int) -> Path:
    """Where the byte-level BPE tokenizer trained on this data is cached (``tokenizers/KEY.json``): the run trains
    it once, later runs, resumes and ``plan`` load it."""
    return cache_root(cfg) / "tokenizers" / f"{built_tokenizer_key(cfg, fmt, vocab_size)}.json"


def _hash_sources(h, specs: list[str]) -> None:
    """Feed the names and bytes of every file the source specs read into ``h`` (and, for a built-in source,
    the version of the code that makes its rows)."""
    for spec in specs:
        if spec in BUILTIN_SOURCES:
            h.update(f"{spec}-v{BUILTIN_ROWS_VERSION}".encode())
        for path in source_files(spec):
            h.update(str(path.name).encode())
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)


def cache_entry(cfg: DataSettings, fmt: str, tokenizer, seed: int, seq2seq: bool = False) -> Path:
    """Where the token store of these settings lives (``entry_dir`` of its ``fingerprint``): what ``prepare_data``
    builds and what ``plan`` looks up. A mixture's entry is joined from one entry per source (``source_entries``),
    keyed by theirs: adding a source tokenizes only it, a share or weight keys nothing, a source's own format,
    fields or template key its entry alone. ``fmt``: the format of data in one entry (a mixture's sources resolve
    their own)."""
    if per_source_entries(cfg):
        keys = [p.name for p in source_entries(cfg, tokenizer, seed, seq2seq)]
        mix = hashlib.blake2b(json.dumps({"v": MIXTURE_VERSION, "sources": keys}).encode(), digest_size=16).hexdigest()
        return entry_dir(cfg, f"mix-{mix}")
    return entry_dir(cfg, fingerprint(shared_settings(cfg), fmt, tokenizer, seed, seq2seq))


MIXTURE_VERSION = 1  # bump when a mixture's entry is joined otherwise (data/mixture_cache.py)


def source_entries(cfg: DataSettings, tokenizer, seed: int, seq2seq: bool = False) -> list[Path]:
    """The entry of each training source of a mixture: the entry a run on that source alone has (read with its
    own settings and format)."""
    formats = source_formats(cfg)
    return [cache_entry(source_settings(cfg, k, formats), f, tokenizer, seed, seq2seq) for k, f in enumerate(formats)]


def entry_dir(cfg: DataSettings, key: str) -> Path:
    """Where the entry ``key`` lives: ``data/KEY`` under ``data.cache_dir`` (or the default cache)."""
    return cache_root(cfg) / "data" / key


class CacheNotWritable(TrainforgeError):
    """The token cache (``$TRAINFORGE_CACHE``, ``data.cache_dir``) is a file, or a directory this user cannot write."""


def cache_root(cfg: DataSettings) -> Path:
    """The token cache directory (``data.cache_dir``, else ``$TRAINFORGE_CACHE`` or ~/.cache/trainforge), checked
    writable (or makeable) before anything is tokenized: ``CacheNotWritable`` names it and what to do."""
    root = cfg.cache_dir or default_cache_dir()
    problem = _not_writable(root)
    if problem is None:
        return root
    env = os.environ.get("TRAINFORGE_CACHE")
    key = "data.cache_dir" if cfg.cache_dir else "TRAINFORGE_CACHE"
    named = f"data.cache_dir: {root}" if cfg.cache_dir else f"TRAINFORGE_CACHE={env}" if env else f"the token cache {root}"
    raise CacheNotWritable(
        f"{named} is not a writable directory ({problem}); set {key} to a directory you can write (it is made if "
        "missing): the token cache holds the tokenized data every run and plan reads"
    )


def _not_writable(path: Path) -> str | None:
    """Why the directory ``path`` cannot be written or made (None: it can): the nearest part that exists decides."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    what = "it" if existing == path else str(existing)
    if existing.is_symlink() and not existing.exists():
        return f"{what} is a symbolic link to a missing path"
    if not existing.is_dir():
        return f"{what} is a file" if existing.is_file() else f"{what} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{what} is read-only to this user"
    return None


def is_complete(root: Path) -> bool:
    """The entry at ``root`` is complete (its ``stats.json``, written last, is there)."""
    return (Path(root) / STATS_FILE).is_file()


def publish_entry(root: Path, build: Callable[[Path], None]) -> bool:
    """Build a cache entry in a temporary directory of this process (``build(tmp)``), then publish it
    at ``root`` unless a complete entry is there (``atomic.publish_dir``).

    Entries of other keys are not waited for. An entry without ``stats.json`` (damaged: a hand
    copy) is replaced. Returns False when another process's entry was used. Leftover temporaries
    of builds whose process is gone are removed first.
    """
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root.parent, STALE_BUILD_S)
    return publish_dir(root, build, is_complete)
