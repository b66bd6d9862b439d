"""Training rows named for a person: each document's source and first words, to find it in the data.

A row index alone (what the loader hands the engine) cannot be looked up in a JSONL file: a packed row
holds several documents, a long one may be a split block, and bad rows were skipped. The beginning of
each document's text, with the source it came from, can be searched for (``grep``) in the files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .store import TokenStore

SHOWN_ROWS, SHOWN_DOCUMENTS, SHOWN_TOKENS, SHOWN_CHARS = 4, 2, 32, 60


def describe_rows(
    store: TokenStore, rows: Sequence[np.ndarray], sources: Sequence[str], tokenizer, indices: Sequence[int],
) -> str:
    """``row 12: train.jsonl "What is the capital of ..."; + 3 more documents | row 40: ...`` for the first
    ``SHOWN_ROWS`` of ``indices`` (rows of ``store``; ``sources``: the path of each of its sources)."""
    parts = []
    for i in list(indices)[:SHOWN_ROWS]:
        if not 0 <= i < len(rows):
            continue
        segments = np.asarray(rows[i]).reshape(-1, 2)
        docs = [_document(store, sources, tokenizer, int(a), int(b)) for a, b in segments[:SHOWN_DOCUMENTS]]
        more = len(segments) - SHOWN_DOCUMENTS
        parts.append(f"row {i}: " + "; ".join(docs) + (f"; + {more} more document{'s' * (more > 1)}" if more > 0 else ""))
    rest = len(indices) - SHOWN_ROWS
    return " | ".join(parts) + (f" | + {rest} more row{'s' * (rest > 1)}" if rest > 0 else "")


def _document(store: TokenStore, sources: Sequence[str], tokenizer, start: int, end: int) -> str:
    """Where the tokens ``[start, end)`` come from and how they begin."""
    seq = int(np.searchsorted(store.offsets, start, "right")) - 1
    k = int(np.searchsorted(store.source_starts, seq, "right")) - 1
    source = sources[k] if 0 <= k < len(sources) else "?"
    ids = np.asarray(store.ids[start : min(end, start + SHOWN_TOKENS)], dtype=np.int64).tolist()
    text = " ".join(tokenizer.decode(ids, skip_special_tokens=True).split())
    shown = text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS or end - start > SHOWN_TOKENS else "")
    return f'{source} "{shown}" ({end - start} tokens)'


def row_describer(store: TokenStore, rows: Sequence[np.ndarray], sources: Sequence[str], tokenizer) -> Callable[[Sequence[int]], str]:
    """``describe_rows`` bound to one run's training rows, as the sentence the engine's messages append
    (``""`` for no rows)."""

    if hasattr(store, "describe"):  # grpo's prompts (rl/prompts.py) say themselves
        return store.describe

    def sentence(indices: Sequence[int]) -> str:
        return f" Their documents (source, first words): {describe_rows(store, rows, sources, tokenizer, indices)}." if indices else ""

    return sentence
