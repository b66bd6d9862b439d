"""From the data config to tokenized train/eval examples."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import DataSettings
from .formats import Example, check_fields, detect_format, pack_blocks, tokenize_documents, tokenize_prompt_completion
from .sources import DataError, Row, iter_rows


@dataclass
class RowSplit:
    """Raw rows of a run, split into train and eval, with their format."""

    format: str
    train: list[Row]
    eval: list[Row] = field(default_factory=list)

    def train_texts(self) -> list[str]:
        """All training text, for training a tokenizer on."""
        keys = ("text",) if self.format == "text" else ("prompt", "completion")
        return [r.data[k] for r in self.train for k in keys]


@dataclass
class Examples:
    train: list[Example]
    eval: list[Example]
    stats: dict[str, int]


def read_split(cfg: DataSettings, seed: int) -> RowSplit:
    """Read the training rows, resolve the format, and hold out the eval rows."""
    train = list(iter_rows(cfg.train, cfg.max_documents))
    if not train:
        raise DataError(f"data.train={cfg.train!r}: no rows found")
    fmt = detect_format(train[0]) if cfg.format == "auto" else cfg.format
    eval_rows: list[Row] = []
    if isinstance(cfg.eval, str):
        eval_rows = list(iter_rows(cfg.eval))
        if not eval_rows:
            raise DataError(f"data.eval={cfg.eval!r}: no rows found")
    elif isinstance(cfg.eval, float):
        if len(train) < 2:
            raise DataError(f"data.eval={cfg.eval}: a held-out fraction needs at least 2 rows, found {len(train)}")
        order = np.random.default_rng(seed).permutation(len(train))
        n_eval = min(len(train) - 1, max(1, round(cfg.eval * len(train))))
        held = set(order[:n_eval].tolist())
        eval_rows = [r for i, r in enumerate(train) if i in held]
        train = [r for i, r in enumerate(train) if i not in held]
    for row in (*train, *eval_rows):
        check_fields(row, fmt)
    return RowSplit(fmt, train, eval_rows)


def tokenize_split(split: RowSplit, tokenizer, max_length: int) -> Examples:
    """Tokenize both sides: text is concatenated into blocks, prompt/completion kept per example."""
    stats: dict[str, int] = {"train_rows": len(split.train), "eval_rows": len(split.eval)}
    if split.format == "text":
        train = pack_blocks(tokenize_documents(split.train, tokenizer), max_length)
        evals = pack_blocks(tokenize_documents(split.eval, tokenizer), max_length)
        stats["truncated"] = stats["dropped"] = 0
    else:
        train, stats["truncated"], stats["dropped"] = tokenize_prompt_completion(split.train, tokenizer, max_length)
        evals, _, _ = tokenize_prompt_completion(split.eval, tokenizer, max_length)
    if not train:
        raise DataError("no training example has a token to learn (all empty or fully masked)")
    stats["train_examples"] = len(train)
    stats["eval_examples"] = len(evals)
    stats["train_tokens"] = int(sum(len(e.input_ids) for e in train))
    stats["train_target_tokens"] = int(sum(int((e.labels >= 0).sum()) for e in train))
    return Examples(train, evals, stats)
