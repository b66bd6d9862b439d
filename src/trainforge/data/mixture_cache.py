"""A mixture's cache entry, joined from the entries of its sources (``cache.source_entries``) by copying their bytes.

Each source is tokenized into the entry a run on it alone would have (its rows held out for eval on their own, so
each source's eval rows are its own share of it). The mixture's entry lays the sources' stores end to end, one
source range each (``sources.npy``): what ``prepare`` tokenized before is never tokenized again, and a mixture's
entry is published atomically like any other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .cache import STATS_FILE
from .source_reads import joined_format
from .store import TokenStore

SAME = ("encoder_decoder", "max_target_length")  # one value for every source
# one value per source, joined where they differ (a chat source truncates, a text one splits: "truncate+split")
JOINED = ("format", "too_long", "eval_holdout")


def join_stores(parts: list[Path], out: Path) -> None:
    """The stores ``parts`` end to end in a store at ``out``, each source of each part a source of its own."""
    stores = [TokenStore(p) for p in parts]
    out.mkdir(parents=True)
    for name in ("ids.bin", "learn.bin"):
        with open(out / name, "wb") as dst:
            for p in parts:
                with open(p / name, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 24)  # bounded memory: 16 MiB at a time
    offsets, starts, base_tokens, base_seqs = [np.zeros(1, np.int64)], [], 0, 0
    for s in stores:
        offsets.append(s.offsets[1:] + base_tokens)
        starts.append(s.source_starts[:-1] + base_seqs)
        base_tokens, base_seqs = base_tokens + int(s.offsets[-1]), base_seqs + len(s)
    np.save(out / "offsets.npy", np.concatenate(offsets))
    np.save(out / "sources.npy", np.concatenate([*starts, [base_seqs]]).astype(np.int64))
    np.save(out / "continues.npy", np.concatenate([s.continues for s in stores]).astype(bool))
    if all(s.desirable is not None for s in stores):
        np.save(out / "desirable.npy", np.concatenate([s.desirable for s in stores]))
    meta = {**stores[0].meta, "sequences": base_seqs, "rows": sum(int(s.meta.get("rows", 0)) for s in stores)}
    del stores  # their memory maps close before anything else touches the files
    (out / "meta.json").write_text(json.dumps(meta, indent=2))


def joined_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of the sources' entries as one entry's: counts summed, shares weighted by tokens."""
    out: dict[str, Any] = {}
    for key, value in parts[0].items():
        values = [p.get(key) for p in parts]
        if key in JOINED:
            out[key] = joined_format([str(v) for v in values])
        elif key in SAME or isinstance(value, (str, bool)) or value is None:
            out[key] = value
        elif isinstance(value, list):
            out[key] = [v for vs in values for v in (vs or [])][:5]
        elif key == "lost_token_share":
            weights = [p.get("train_tokens", 0) for p in parts]
            out[key] = sum(w * v for w, v in zip(weights, values)) / max(sum(weights), 1)
        else:
            out[key] = sum(v or 0 for v in values)
    out["source_formats"] = [p.get("format") for p in parts]  # each source's (summary.json: data.sources' format)
    return out


def join_entries(roots: list[Path], out: Path) -> None:
    """Build a mixture's entry at ``out`` from its sources' complete entries ``roots`` (``stats.json`` last)."""
    stats = [json.loads((r / STATS_FILE).read_text()) for r in roots]
    join_stores([r / "train" for r in roots], out / "train")
    kind = stats[0].get("eval_holdout")  # every source's: a file, or a fraction (of its rows or its blocks), or none
    if kind == "file":  # the one eval file, read by the first source's settings (data/source_reads.py)
        join_stores([roots[0] / "eval"], out / "eval")
    elif kind in ("rows", "blocks"):  # each source's own held-out share, a source each
        join_stores([r / "eval" for r in roots], out / "eval")
    joined = joined_stats(stats)
    if kind == "file":  # counted once, not once per source
        joined.update({k: stats[0][k] for k in ("eval_rows", "eval_sequences") if k in stats[0]})
    (out / STATS_FILE).write_text(json.dumps(joined, indent=2))  # last: it marks the entry complete
