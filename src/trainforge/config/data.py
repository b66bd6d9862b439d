"""The data section of a run config: its sources (files, directories, globs, built-ins, weighted mixtures), field
names, formats, lengths and packing, and the checks on a data path that run before anything opens it."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from .base import MAX_TOKENS, Section
from .errors import ConfigError, shown

BUILTIN_STDLIB = "builtin:python-stdlib"
"""Text source: the Python standard library's own sources, present on every install."""
BUILTIN_FUNCTIONS = "builtin:python-functions"
"""Prompt/completion source: stdlib functions, signature + docstring -> body."""
BUILTIN_FUNCTION_PAIRS = "builtin:python-function-pairs"
"""Preference source: stdlib functions, signature + docstring -> the real body (chosen) or its lines reversed (rejected)."""
BUILTIN_FUNCTION_LABELS = "builtin:python-function-labels"
"""Unpaired (KTO) source: the same functions, every other one with its real body (label true), the rest reversed (false)."""
BUILTIN_ARITHMETIC = "builtin:arithmetic"
"""Prompt source with a checkable answer: sums of two numbers 0-19 (``{prompt, completion, answer}``), for grpo."""
BUILTINS = (BUILTIN_STDLIB, BUILTIN_FUNCTIONS, BUILTIN_FUNCTION_PAIRS, BUILTIN_FUNCTION_LABELS, BUILTIN_ARITHMETIC)


def default_cache_dir() -> Path:
    """Where token caches and machine probes live: $TRAINFORGE_CACHE, else ~/.cache/trainforge."""
    return Path(os.environ.get("TRAINFORGE_CACHE") or Path.home() / ".cache" / "trainforge")


class FieldNames(Section):
    """Names of the fields each format reads, for data whose columns are named otherwise."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"
    chosen: str = Field("chosen", description="preference pairs: the preferred reply (StackExchange-paired: response_j)")
    rejected: str = Field("rejected", description="preference pairs: the other reply (StackExchange-paired: response_k)")
    label: str = Field("label", description="unpaired (KTO) rows: true for a desirable completion, false otherwise")


DataFormat = Literal["auto", "text", "prompt_completion", "chat", "alpaca", "source_target", "preference", "unpaired"]
READ_KEYS = ("format", "fields", "chat_template")
"""The data keys a source of a mixture may set for itself (its rows read its own way); unset: the data section's."""


class SourceSpec(Section):
    """One training source of a mixture: a row multiplier (``weight``) or a share of the tokens (``share``), and how
    its rows are read where that differs from the data section (``format``, ``fields``, ``chat_template``)."""

    path: str = Field(..., description="file, directory, glob, or " + BUILTIN_STDLIB)
    weight: float = Field(
        1.0, gt=0, le=1000, description="rows of this source per epoch = weight x its rows (fraction sampled, seeded)"
    )
    share: float | None = Field(
        None, gt=0, le=1, description="this source's share of the training tokens per epoch of the mixture (every "
        "source of the list gives one, they sum to 1; rows repeated or subsampled, seeded); not with weight",
    )
    name: str | None = Field(
        None, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
        description="the source's name in per-source figures and losses (loss/NAME); default: from its path",
    )
    format: DataFormat | None = Field(
        None, description="this source's data.format (default: the data section's; auto: from this source's first row)"
    )
    fields: FieldNames | None = Field(
        None, description="this source's field names, over data.fields (only the names given change), e.g. "
        "{prompt: question, completion: answer}",
    )
    chat_template: str | None = Field(
        None, description="this source's chat template (text or a template file), instead of data.chat_template"
    )

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        _check_source(v)
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, v: str | None) -> str | None:
        return template_text(v)

    @model_serializer(mode="wrap")
    def _unset_read_keys_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The read keys as given: unset ones left out (a checkpoint's ``data.train`` of a run before they existed
        stays equal), ``fields`` only the names given (a saved config.yaml reads back with the same merge)."""
        out = handler(self)
        for key in READ_KEYS:
            if getattr(self, key) is None:
                out.pop(key, None)
        if self.fields is not None:
            out["fields"] = {k: getattr(self.fields, k) for k in FieldNames.model_fields if k in self.fields.model_fields_set}
        return out

    def read_keys(self) -> dict[str, Any]:
        """The read keys this source sets (``format``, ``fields``, ``chat_template``), as given."""
        return {k: getattr(self, k) for k in READ_KEYS if getattr(self, k) is not None}


class DataSettings(Section):
    train: str | list[str | SourceSpec] = Field(
        ..., description=f"file, directory, glob, {BUILTIN_STDLIB}, {BUILTIN_FUNCTIONS}, {BUILTIN_FUNCTION_PAIRS}, {BUILTIN_FUNCTION_LABELS}, {BUILTIN_ARITHMETIC}, or a list of these / of {{path, weight}} / of {{path, share}}; a source of a list may set its own format, fields and chat_template"
    )
    eval: str | float | None = Field(
        0.05,
        description="a file/glob, or a fraction held out of the training data (seeded, by content): of the rows, "
        "or of the blocks when too_long is split; null: none",
    )
    format: DataFormat = Field(
        "auto",
        description="auto: from the fields of the first row; source_target: {source, target} or {input, output} "
        "rows (a prompt and its completion); preference: chosen/rejected pairs (train.objective dpo, ipo, orpo, simpo); unpaired: completions with a "
        "true/false label (train.objective kto), or pairs read as a desirable chosen and an undesirable rejected example",
    )
    fields: FieldNames = Field(default_factory=FieldNames)
    chat_template: str | None = Field(
        None, description="Jinja chat template, as text or a path to a template file (its text is kept in the run's "
        "config.yaml); default: the tokenizer's, else trainforge's ChatML-style one",
    )
    train_on_prompt: bool = Field(
        False, description="also learn prompt / user / system tokens (default: completion- / assistant-only)"
    )
    max_length: int | Literal["auto"] = Field(
        1024, description="tokens per training row; encoder-decoder models: source tokens per example (the encoder's side); "
        "auto (decoder-only models): the longest that fits a step at the run's micro-batch (one row when that is auto) with "
        "its method and long-context levers on this machine, as `trainforge plan --longest` finds it, at most the model's "
        f"positions (docs/long-context.md) (> 0, <= {MAX_TOKENS})",
    )
    max_target_length: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="encoder-decoder models only: target tokens per example (the decoder's side, its EOS "
        "included); default: data.max_length",
    )
    too_long: Literal["truncate", "drop", "split"] | None = Field(
        None,
        description="examples longer than max_length: cut, skip, or (text only) split into blocks; "
        "default: split for text, truncate for prompt/completion, chat and alpaca (encoder-decoder: a source over "
        "max_length or a target over max_target_length, truncate keeping its EOS, or drop)",
    )
    packing: bool | Literal["concat"] = Field(
        True,
        description="true: pack examples into full rows, documents isolated; concat: classic joined stream "
        "cut into blocks; false: one example per row, batches grouped by length (encoder-decoder models: "
        "always false, and false when unset)",
    )
    txt_mode: Literal["file", "paragraph"] = Field("file", description=".txt files: one document per file or per blank-line block")
    on_bad_row: Literal["error", "skip"] = Field("error", description="skip: count bad rows and go on")
    cache_dir: Path | None = Field(
        None, description="token cache (default: $TRAINFORGE_CACHE or ~/.cache/trainforge)"
    )
    num_workers: int | None = Field(None, ge=1, le=1024, description="tokenizer processes (default: all cores)")
    max_documents: int | None = Field(None, gt=0, le=10**12, description="read at most this many documents (quick tries)")

    @field_validator("train")
    @classmethod
    def _train_exists(cls, v: str | list[str | SourceSpec]) -> str | list[str | SourceSpec]:
        for spec in [v] if isinstance(v, str) else v:
            if isinstance(spec, str):
                _check_source(spec)
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, v: str | None) -> str | None:
        return template_text(v)

    @field_validator("max_length")
    @classmethod
    def _row_length(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 < v <= MAX_TOKENS:
            raise ValueError(f"must be greater than 0 and at most {MAX_TOKENS} tokens, or auto")
        return v

    @field_validator("eval")
    @classmethod
    def _eval_valid(cls, v: str | float | None) -> str | float | None:
        if isinstance(v, float) and not 0.0 < v < 1.0:
            raise ValueError("a held-out fraction must be between 0 and 1 (exclusive), e.g. 0.05")
        if isinstance(v, str):
            _check_source(v)
        return v

    @model_validator(mode="after")
    def _mixture_valid(self) -> "DataSettings":
        check_mixture(self.sources())
        return self

    @model_validator(mode="after")
    def _split_needs_text(self) -> "DataSettings":
        if self.too_long == "split" and self.format not in ("auto", "text"):
            raise ValueError(f"data.too_long: 'split' is for text only; data.format is {self.format!r}; use truncate or drop")
        for k, spec in enumerate(self.sources()):
            if self.too_long == "split" and spec.format not in (None, "auto", "text"):
                raise ValueError(f"data.too_long: 'split' is for text only; data.train[{k}] ({shown(spec.path)}) has format "
                                 f"{spec.format!r}; use truncate or drop")
        return self

    def target_limit(self) -> int:
        """Target tokens per example of an encoder-decoder model: ``max_target_length``, else ``max_length``."""
        return self.max_target_length or self.row_length()

    def row_length(self) -> int:
        """``max_length`` once resolved; ``auto`` is resolved at set-up (engine/row_length.py) before anything reads it."""
        if self.max_length == "auto":
            raise ConfigError("data.max_length: auto must be resolved (engine/row_length.py) before the row length is read")
        return self.max_length

    def too_long_for(self, fmt: str) -> str:
        """The too-long policy for data of format ``fmt``: the set one, else split for text, truncate otherwise."""
        return self.too_long or ("split" if fmt == "text" else "truncate")

    # how the user gave the sources and sets the objective, where a tool builds these settings itself
    _named_as: str | None = PrivateAttr(default=None)
    _objective_hint: str | None = PrivateAttr(default=None)
    _setting_form: str | None = PrivateAttr(default=None)

    def source_label(self) -> str:
        """The training sources as the user gave them, for messages: ``data.train='x.jsonl'``, or what
        ``named_as`` set (``trainforge eval``'s ``--data x.jsonl``: a key the user never wrote)."""
        return self._named_as or f"data.train={self.train!r}"

    def objective_hint(self, *objectives: str) -> str:
        """What to do when the data want another objective: ``set train.objective to dpo, ipo or simpo``, or
        ``named_as``'s hint with the first of ``objectives``."""
        if self._objective_hint:
            return self._objective_hint.format(objectives[0])
        listed = objectives[0] if len(objectives) == 1 else ", ".join(objectives[:-1]) + " or " + objectives[-1]
        return f"set train.objective to {listed}"

    def setting(self, key: str, value: str) -> str:
        """A setting to change, for messages: ``data.format: unpaired``, or in ``named_as``'s form
        (``trainforge eval``: ``--set data.format=unpaired``)."""
        return (self._setting_form or "{}: {}").format(key, value)

    def named_as(self, label: str, objective_hint: str | None = None, setting_form: str | None = None) -> "DataSettings":
        """A copy whose messages name the sources ``label``; ``objective_hint``: a format string for
        ``objective_hint`` (``{}``: the objective), as the tool sets it; ``setting_form``: one for ``setting``
        (``{}``: the key, then the value)."""
        copy = self.model_copy()
        copy._named_as, copy._objective_hint, copy._setting_form = label, objective_hint, setting_form
        return copy

    def sources(self) -> list[SourceSpec]:
        """The training sources as specs with weights."""
        items = [self.train] if isinstance(self.train, str) else self.train
        return [SourceSpec(path=i) if isinstance(i, str) else i for i in items]

    def read_as(self, k: int) -> "DataSettings":
        """These settings with source ``k``'s own read keys over the data section's (``format``, ``chat_template``
        replaced, ``fields`` renamed name by name); ``train`` unchanged."""
        spec = self.sources()[k]
        update: dict[str, Any] = {key: v for key, v in spec.read_keys().items() if key != "fields"}
        if spec.fields is not None:
            update["fields"] = self.fields.model_copy(update={n: getattr(spec.fields, n) for n in spec.fields.model_fields_set})
        return self.model_copy(update=update) if update else self

    def for_source(self, k: int) -> "DataSettings":
        """The settings source ``k`` is read with, alone (``train`` its path): what a run on it alone would have."""
        return self.read_as(k).model_copy(update={"train": self.sources()[k].path})

    def set_formats(self) -> list[tuple[str, str]]:
        """(key, format) of ``data.format`` and of each source's own format, as messages name them
        (``data.train[1].format``)."""
        return [("data.format", self.format)] + [
            (f"data.train[{k}].format", s.format) for k, s in enumerate(self.sources()) if s.format is not None]

    # an entry of one source of a mixture whose eval file is read by the first source's settings, not its own
    _eval_file_tokens: bool = PrivateAttr(default=True)

    @property
    def eval_file_tokens(self) -> bool:
        """Whether an eval file (``data.eval``) is tokenized with these settings (else only its rows are dropped
        from training: a source of a mixture read otherwise than the first, whose settings read the file)."""
        return self._eval_file_tokens

    def without_eval_tokens(self) -> "DataSettings":
        """A copy whose eval file is not tokenized (``eval_file_tokens``)."""
        copy = self.model_copy()
        copy._eval_file_tokens = False
        return copy


SHARE_SUM_TOLERANCE = 1e-3  # 0.7 + 0.2 + 0.1 written in floats is 0.9999999999999999


def check_mixture(specs: list[SourceSpec]) -> None:
    """A mixture gives shares on every source or on none, never beside a weight; shares sum to 1 (they are
    refused otherwise, not normalized: a typo in one share would silently shift all the others)."""
    sharing = [s for s in specs if s.share is not None]
    if not sharing:
        return
    for k, s in enumerate(specs):
        if s.share is None:
            raise ValueError(f"data.train[{k}] ({shown(s.path)}) has no share while other sources give one: give every "
                             "source a share (summing to 1), or use weight on all of them")
        if s.weight != 1.0:  # 1.0 beside a share: a dumped config (a run's config.yaml) spells every default out
            raise ValueError(f"data.train[{k}] ({shown(s.path)}) gives both share and weight: a mixture takes one of "
                             "the two (share: a share of the tokens; weight: a multiple of the rows)")
    total = sum(s.share for s in sharing)
    if abs(total - 1.0) > SHARE_SUM_TOLERANCE:
        listed = ", ".join(f"{shown(s.path)} {s.share:g}" for s in specs)
        raise ValueError(f"data.train shares sum to {total:g} ({listed}), not 1: make them sum to 1 (they are not "
                         "rescaled)")


def template_text(v: str | None) -> str | None:
    """A chat template setting as the template's text: given as text, or read from the file it names."""
    if v is None or "{{" in v or "{%" in v:
        return v
    try:
        path = Path(v).expanduser()
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            if "{{" in text or "{%" in text:
                return text
            raise ValueError(f"{shown(v)} holds no Jinja template (no {{{{ }}}} or {{% %}})")
    except OSError:  # a template's text too long to be a file name
        pass
    except UnicodeDecodeError:
        raise ValueError(f"{shown(v)} is not a UTF-8 text file") from None
    raise ValueError(
        f"{shown(v)} is neither a Jinja template (it has no {{{{ }}}} or {{% %}}) nor a file; give the template's "
        "text or a path to a .jinja file (a model's own template is used when this is unset)"
    )


def _check_source(spec: str) -> None:
    if spec in BUILTINS:
        return
    try:
        if Path(spec).is_dir():
            return
    except OSError as e:  # a name too long for the file system
        raise ValueError(f"cannot use {shown(spec)}: {e.strerror}") from None
    matches = glob.glob(spec)
    if not matches:
        raise ValueError(f"no file matches {shown(spec)} (a file, directory, glob, or one of {', '.join(BUILTINS)})")
    for match in matches:  # opening a FIFO would wait for a writer forever
        if what := not_a_data_file(match):
            raise ValueError(f"{shown(match)} is {what}; give a data file (copy the data into a file first)")


def not_a_data_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is where it is neither a directory nor a regular file (a FIFO, device or socket, which
    opening would wait on forever, or a symbolic link to a missing file), or None."""
    if os.path.isdir(path) or os.path.isfile(path) or not os.path.lexists(path):
        return None
    return "not a regular file (a device, pipe or socket)" if os.path.exists(path) else "a symbolic link to a missing file"


