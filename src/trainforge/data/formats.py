"""Turn rows into training examples: token ids plus aligned next-token labels.

Labels are already shifted (``labels[t]`` is the target for ``input_ids[t]``) and hold
``IGNORE`` where no loss is taken, so the engine never shifts or searches for markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .sources import DataError, Row

IGNORE = -100
FORMAT_FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion")}


@dataclass
class Example:
    input_ids: np.ndarray  # int32, (T,)
    labels: np.ndarray  # int32, (T,), IGNORE where no loss


def detect_format(row: Row) -> str:
    """``text`` or ``prompt_completion`` from a row's fields."""
    for name in ("prompt_completion", "text"):
        if all(k in row.data for k in FORMAT_FIELDS[name]):
            return name
    raise DataError(
        f"{row.where}: cannot tell the data format from fields {sorted(row.data)}; expected "
        "'text' (pretraining) or 'prompt' and 'completion'; or set data.format"
    )


def check_fields(row: Row, fmt: str) -> None:
    for field in FORMAT_FIELDS[fmt]:
        if field not in row.data:
            raise DataError(f"{row.where}: missing field {field!r} required by data.format={fmt}")
        if not isinstance(row.data[field], str):
            got = type(row.data[field]).__name__
            raise DataError(f"{row.where}: field {field!r} must be a string, got {got}")


def tokenize_documents(rows: Sequence[Row], tokenizer, batch_size: int = 256) -> list[np.ndarray]:
    """Each document's ids followed by EOS (the document separator of pretraining streams)."""
    eos = tokenizer.eos_token_id
    out: list[np.ndarray] = []
    for start in range(0, len(rows), batch_size):
        texts = [r.data["text"] for r in rows[start : start + batch_size]]
        for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
            out.append(np.asarray(ids + ([eos] if eos is not None else []), dtype=np.int32))
    return out


def pack_blocks(docs: list[np.ndarray], max_length: int) -> list[Example]:
    """Concatenate documents and cut into rows of ``max_length`` inputs (nanoGPT-style x/y).

    Consecutive rows overlap by one token so every token after the first is a target once;
    the last, shorter row is kept so no data is dropped.
    """
    if not docs:
        return []
    stream = np.concatenate(docs)
    out = []
    for start in range(0, max(len(stream) - 1, 0), max_length):
        chunk = stream[start : start + max_length + 1]
        if len(chunk) >= 2:
            out.append(Example(chunk[:-1].copy(), chunk[1:].copy()))
    return out


def tokenize_prompt_completion(
    rows: Sequence[Row], tokenizer, max_length: int, batch_size: int = 256
) -> tuple[list[Example], int, int]:
    """Prompt + completion + EOS, loss on completion tokens only.

    Returns (examples, truncated count, dropped count): a row whose completion was cut away
    entirely has nothing to learn and is dropped.
    """
    eos = tokenizer.eos_token_id
    examples: list[Example] = []
    truncated = dropped = 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        prompts = tokenizer([r.data["prompt"] for r in batch], add_special_tokens=True)["input_ids"]
        completions = tokenizer([r.data["completion"] for r in batch], add_special_tokens=False)["input_ids"]
        for p, c in zip(prompts, completions):
            ids = p + c + ([eos] if eos is not None else [])
            learn = [False] * len(p) + [True] * (len(ids) - len(p))
            if len(ids) > max_length + 1:
                ids, learn = ids[: max_length + 1], learn[: max_length + 1]
                truncated += 1
            arr = np.asarray(ids, dtype=np.int32)
            labels = np.where(np.asarray(learn[1:]), arr[1:], IGNORE).astype(np.int32)
            if (labels != IGNORE).any():
                examples.append(Example(arr[:-1].copy(), labels))
            else:
                dropped += 1
    return examples, truncated, dropped
