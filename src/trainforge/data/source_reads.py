"""How each training source is read: its format and settings (a source's own ``format``, ``fields`` and
``chat_template`` over the data section's), which sources share one cache entry, and the checks of a mixture's
formats that run before anything is tokenized.

A source that sets none of these keys is read as the data section says; ``format: auto`` (the default) detects
each source's format from its own first row, so a chat file beside a text corpus reads each its way. SFT formats
(text, prompt/completion, chat, alpaca, source/target) mix in one run: each is a token sequence with the tokens to
learn marked. Preference pairs and KTO rows mix only with their own kind (one objective reads them).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

from ..config.data import DataSettings
from .chat_messages import SHAREGPT_FIELD
from .formats import conversational_prompt, detect_format, source_target_keys
from .sources import BadRows, DataError, Row, iter_source

PAIRED = ("preference", "unpaired")
MIXED = "+"  # joins the formats of a mixture whose sources differ: "chat+text"


def train_rows(cfg: DataSettings, bad: BadRows) -> Iterator[tuple[int, Row]]:
    """(source index, row) over every training source, at most ``max_documents`` rows."""
    rows = ((k, row) for k, spec in enumerate(cfg.sources()) for row in iter_source(spec.path, bad, cfg.txt_mode))
    return islice(rows, cfg.max_documents) if cfg.max_documents else rows


def _first_row_format(cfg: DataSettings) -> str:
    """``data.format``, or (auto) the format of the first good row of ``cfg``'s training sources."""
    if cfg.format != "auto":
        return cfg.format
    bad = BadRows("skip")
    first = next(train_rows(cfg, bad), None)
    if first is None:
        raise DataError(f"{cfg.source_label()}: no rows found" + (f"; every row is bad, first: {bad.first[0]}" if bad.count else ""))
    return detect_format(first[1], cfg.fields)


def source_formats(cfg: DataSettings) -> list[str]:
    """The format each training source is read with: its own ``format``, else ``data.format``, else (auto) its first
    row's under its field names. A source whose format cannot be told is a ``DataError`` naming it."""
    specs = cfg.sources()
    if len(specs) == 1:
        return [_first_row_format(cfg.read_as(0))]
    formats = []
    for k, spec in enumerate(specs):
        try:
            formats.append(_first_row_format(cfg.for_source(k)))
        except DataError as e:
            raise DataError(f"data.train[{k}] ({spec.path!r}): {e}") from None
    return formats


def joined_format(formats: list[str]) -> str:
    """The format of a mixture: its sources' one format, or theirs joined (``chat+text``) where they differ."""
    return MIXED.join(dict.fromkeys(formats))


def format_parts(fmt: str) -> list[str]:
    """The formats a (joined) format names: ``chat+text`` -> [chat, text]."""
    return fmt.split(MIXED)


def _read_key(cfg: DataSettings, fmt: str) -> tuple:
    """What decides how rows are read: the format, the field names and the chat template."""
    return fmt, tuple(cfg.fields.model_dump().items()), cfg.chat_template


def per_source_entries(cfg: DataSettings) -> bool:
    """Whether the training sources get a cache entry each: a list of two or more read whole, or with
    ``max_documents`` (a row budget across them) where they are read in different ways (each is then given what is
    left of the budget after the sources before it)."""
    if not isinstance(cfg.train, list) or len(cfg.train) < 2:
        return False
    if not cfg.max_documents:
        return True
    formats = source_formats(cfg)
    return len({_read_key(cfg.read_as(k), f) for k, f in enumerate(formats)}) > 1


def resolve_format(cfg: DataSettings) -> str:
    """The format of the training data: of its one entry, or a mixture's sources' (``joined_format``)."""
    if per_source_entries(cfg):
        return joined_format(source_formats(cfg))
    return _first_row_format(shared_settings(cfg))


def shared_settings(cfg: DataSettings) -> DataSettings:
    """The settings of training data tokenized into one entry (one source, or a mixture read one way): the data
    section's, with the first source's read keys (the same on every source, or it would have an entry each)."""
    return cfg.read_as(0) if isinstance(cfg.train, list) else cfg


def source_settings(cfg: DataSettings, k: int, formats: list[str] | None = None) -> DataSettings:
    """The data settings of the training source ``k`` alone (its own entry); ``formats``: ``source_formats(cfg)``
    where known. An eval file is read by the first source's settings: a source read otherwise only drops its rows."""
    sub = cfg.for_source(k)
    if cfg.max_documents:
        sub = sub.model_copy(update={"max_documents": _budget(cfg, k)})
    if isinstance(cfg.eval, str) and k > 0:
        formats = formats or source_formats(cfg)
        if _read_key(sub, formats[k]) != _read_key(cfg.for_source(0), formats[0]):
            sub = sub.without_eval_tokens()
    return sub


def _budget(cfg: DataSettings, k: int) -> int:
    """The rows source ``k`` may read: what ``max_documents`` leaves after the sources before it."""
    left = cfg.max_documents or 0
    for spec in cfg.sources()[:k]:
        left -= sum(1 for _ in islice(iter_source(spec.path, BadRows("skip"), cfg.txt_mode), left))
    if left <= 0:
        raise DataError(f"data.train[{k}] ({cfg.sources()[k].path!r}) gets no rows: data.max_documents "
                        f"({cfg.max_documents}) is used up by the sources before it; raise it or unset it")
    return left


def read_parts(cfg: DataSettings) -> list[tuple[DataSettings, str]]:
    """(settings, format) of each part of the training data read one way: each source of a mixture with an
    entry each, else the data as one."""
    if per_source_entries(cfg):
        formats = source_formats(cfg)
        return [(source_settings(cfg, k, formats), f) for k, f in enumerate(formats)]
    shared = shared_settings(cfg)
    return [(shared, _first_row_format(shared))]


def _fits(row: Row, fmt: str, cfg: DataSettings) -> bool:
    """Whether ``row`` has the fields format ``fmt`` reads under ``cfg``'s field names."""
    n, data = cfg.fields, row.data
    if fmt == "chat":
        return n.messages in data or isinstance(data.get(SHAREGPT_FIELD), list) or conversational_prompt(row, n)
    if fmt == "source_target":
        return source_target_keys(row, n) is not None
    if fmt == "unpaired":
        return (n.chosen in data and n.rejected in data) or (
            n.label in data and any(f in data for f in (n.completion, n.messages, SHAREGPT_FIELD)))
    needs = {"text": (n.text,), "prompt_completion": (n.prompt, n.completion), "alpaca": (n.instruction, n.output),
             "preference": (n.chosen, n.rejected)}[fmt]
    return all(f in data for f in needs)


def _needs(fmt: str, cfg: DataSettings) -> str:
    """What format ``fmt`` reads, for a message."""
    n = cfg.fields
    return {
        "text": f"a {n.text!r} field", "prompt_completion": f"{n.prompt!r} and {n.completion!r} fields",
        "chat": f"a {n.messages!r} (or {SHAREGPT_FIELD!r}) field", "alpaca": f"{n.instruction!r} and {n.output!r} fields",
        "source_target": f"'source' and 'target' (or {n.input!r} and {n.output!r}) fields",
        "preference": f"{n.chosen!r} and {n.rejected!r} fields",
        "unpaired": f"a {n.label!r} with {n.completion!r} or {n.messages!r}, or {n.chosen!r} and {n.rejected!r} fields",
    }[fmt]


def _check_fields(cfg: DataSettings, k: int, fmt: str) -> None:
    """``DataError`` naming source ``k`` when its format is set (its own or the data section's) and its first row
    lacks that format's fields: said before a tokenizer is trained or anything tokenized."""
    sub, spec = cfg.for_source(k), cfg.sources()[k]
    first = next(iter_source(spec.path, BadRows("skip"), cfg.txt_mode), None)
    if sub.format == "auto" or first is None or _fits(first, fmt, sub):
        return
    key = f"data.train[{k}].format" if spec.format else "data.format"
    try:
        found = detect_format(first, sub.fields)
        hint = f"; its rows look like {found} data: set data.train[{k}].format: {found}"
    except DataError:
        hint = ""
    raise DataError(
        f"data.train[{k}] ({spec.path!r}): format {fmt!r} ({key}) needs {_needs(fmt, sub)}, but its first row "
        f"({first.where}) has fields {sorted(first.data)}: name them with data.train[{k}].fields (e.g. "
        f"{{prompt: question, completion: answer}}), or set its format{hint}"
    )


def _kind(fmt: str) -> str:
    return fmt if fmt in PAIRED else "sft"


def check_source_formats(cfg: DataSettings) -> list[str]:
    """The format of each source of a mixture, checked before anything is tokenized: a set format whose fields the
    source's first row lacks, and a source of another kind than the first (pairs in an SFT mixture), are a
    ``DataError`` naming the source. One source: nothing checked here (its rows' errors name them)."""
    specs = cfg.sources()
    if len(specs) < 2:
        return []
    formats = source_formats(cfg)
    for k, fmt in enumerate(formats):
        if cfg.on_bad_row == "error":  # with skip, rows of other fields are skipped and counted
            _check_fields(cfg, k, fmt)
        if _kind(fmt) != _kind(formats[0]):
            first = f"data.train[0] ({specs[0].path!r}) is {formats[0]} data"
            raise DataError(
                f"data.train[{k}] ({specs[k].path!r}) holds {fmt} rows, but {first}: SFT sources (text, "
                "prompt_completion, chat, alpaca, source_target) mix in one run, preference pairs and KTO rows only "
                "with sources of their own kind (one objective reads them); convert it, or train on it in a run of its own"
            )
    return formats
