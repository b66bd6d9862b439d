"""Mixtures of training sources: which stored sequences one epoch of the mixture holds, and what each source got.

``weight``: a source's sequences repeated ``weight`` times per epoch (the fraction a seeded sample), so its token
share depends on its row lengths. ``share``: a source's share of the epoch's tokens. The epoch is as many tokens
as the sources hold together; a source gets ``share x`` that, as whole copies of its sequences and a seeded
sample of the rest, the sample's length picked to land closest to the target.

Preference stores hold a pair as sequences 2k and 2k + 1: a pair is one unit (its even index stands for it,
as ``plan.rows_for`` reads it), its tokens both sides'.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..config.data import BUILTINS, DataSettings, SourceSpec
from .packing import weighted_indices
from .sources import DataError
from .store import TokenStore

SHARE_TOLERANCE = 0.01  # a share reached farther than this (absolute) from the asked one is warned about


def source_names(specs: list[SourceSpec]) -> list[str]:
    """Short unique names of the sources (``loss/NAME``): the spec's ``name``, else its file or directory name
    without data suffixes (``chat`` for ``data/chat.jsonl.gz``), a built-in's name after ``builtin:``."""
    names: list[str] = []
    for k, spec in enumerate(specs):
        if spec.name:
            base = spec.name
        elif spec.path in BUILTINS:
            base = spec.path.split(":", 1)[1]
        else:
            base = Path(spec.path.rstrip("/")).name
            while Path(base).suffix in (".gz", ".jsonl", ".json", ".csv", ".parquet", ".txt"):
                base = base[: -len(Path(base).suffix)]
            base = re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_.") or f"source{k}"
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


@dataclass
class SourceFigures:
    """What one source holds and what one epoch of the mixture takes of it."""

    name: str
    path: str
    documents: int  # stored training sequences (after filtering, hold-out and splitting)
    tokens: int  # their input tokens
    mixture_documents: int  # sequences per epoch of the mixture (repeats counted)
    mixture_tokens: int
    share: float  # of the mixture's tokens
    share_asked: float | None
    weight: float | None
    epochs_per_mixture_epoch: float  # times its sequences are seen per epoch of the mixture
    format: str | None = None  # what its rows were read as (a source's own format, or the mixture's)
    epochs: float | None = None  # over the run (set once its length is known)


def _units(store: TokenStore, k: int, paired: bool) -> tuple[np.ndarray, np.ndarray]:
    """(unit indices, input tokens of each) of source ``k``: sequences, or pairs by their even index."""
    r = store.source_of(k)
    idx = np.arange(r.start, r.stop, 2 if paired else 1, dtype=np.int64)
    inputs = store.lengths.astype(np.int64) - 1
    tokens = inputs[idx] + (inputs[idx + 1] if paired and len(idx) else 0)
    return idx, tokens


def share_indices(store: TokenStore, shares: list[float], seed: int, paired: bool = False) -> np.ndarray:
    """Sequence indices of one epoch of a share mixture: source k holds ``shares[k]`` of its tokens."""
    units = [_units(store, k, paired) for k in range(len(shares))]
    total = sum(int(t.sum()) for _, t in units)
    rng = np.random.default_rng([seed, 11])
    parts = []
    for share, (idx, tokens) in zip(shares, units):
        have = int(tokens.sum())
        if have == 0:
            continue
        target = share * total
        copies = int(target // have)
        parts.extend([idx] * copies)
        rest = target - copies * have
        order = rng.permutation(len(idx))
        cum = np.concatenate([[0], np.cumsum(tokens[order])])
        m = int(np.abs(cum - rest).argmin())  # the sample whose tokens land closest to the rest of the target
        if m:
            parts.append(np.sort(idx[order[:m]]))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def mixture_indices(store: TokenStore, specs: list[SourceSpec], seed: int, paired: bool = False) -> np.ndarray:
    """Sequence indices of one epoch of the mixture ``specs`` (shares or weights)."""
    if specs and specs[0].share is not None:
        return share_indices(store, [s.share for s in specs], seed, paired)
    return weighted_indices(store, [s.weight for s in specs], seed)


def mixture_figures(store: TokenStore, specs: list[SourceSpec], index: np.ndarray, paired: bool = False,
                    formats: list[str] | None = None) -> list[SourceFigures]:
    """Per source: what it holds, what the epoch ``index`` takes of it, against what was asked; ``formats``: what
    each was read as."""
    source = np.searchsorted(store.source_starts, index, "right") - 1
    inputs = store.lengths.astype(np.int64) - 1
    taken = inputs[index] + (inputs[index + 1] if paired and len(index) else 0)
    if paired:  # rows_for keeps the even index of each pair
        keep = index % 2 == 0
        source, taken = source[keep], taken[keep]
    total = max(int(taken.sum()), 1)
    figures = []
    for k, (spec, name) in enumerate(zip(specs, source_names(specs))):
        idx, tokens = _units(store, k, paired)
        mine = source == k
        got = int(taken[mine].sum())
        have = int(tokens.sum())
        figures.append(SourceFigures(
            name=name, path=spec.path, documents=len(idx), tokens=have, mixture_documents=int(mine.sum()),
            mixture_tokens=got, share=got / total, share_asked=spec.share,
            weight=None if spec.share is not None else spec.weight,
            epochs_per_mixture_epoch=got / have if have else 0.0, format=formats[k] if formats else None,
        ))
    return figures


def check_sources_filled(store: TokenStore, specs: list[SourceSpec]) -> None:
    """``DataError`` naming a source of a mixture that holds no training sequence after filtering."""
    if len(specs) < 2:
        return  # one source: an empty one is the "nothing to learn" error of prepare
    for k, spec in enumerate(specs):
        if k < store.n_sources and len(store.source_of(k)) == 0:
            raise DataError(
                f"data.train[{k}] ({spec.path!r}) holds no training example after filtering (every row bad and "
                "skipped, too long and dropped, held out for eval, or past data.max_documents): fix its rows or "
                "remove it from the mixture"
            )


def add_run_epochs(figures: list[dict], rows_per_epoch: int, rows_over_run: int) -> None:
    """Each source's epochs over the run (``epochs``), from the mixture's: the run trains ``rows_over_run`` rows
    of a mixture epoch of ``rows_per_epoch``."""
    mixture_epochs = rows_over_run / max(rows_per_epoch, 1)
    for f in figures:
        f["epochs"] = f["epochs_per_mixture_epoch"] * mixture_epochs


def figures_dicts(figures: list[SourceFigures]) -> list[dict]:
    return [asdict(f) for f in figures]


def describe_mixture(figures: list[dict]) -> list[str]:
    """Console lines: one per source, what it holds and got against what was asked (and its format, where the
    sources' differ); warnings for missed shares."""
    lines = []
    mixed = len({f.get("format") for f in figures}) > 1
    for f in figures:
        asked = f"share {f['share']:.1%} (asked {f['share_asked']:.1%})" if f["share_asked"] is not None else \
            f"share {f['share']:.1%} (weight {f['weight']:g})"
        epochs = f", {f['epochs']:.2f} epochs over the run" if f.get("epochs") is not None else ""
        read_as = f" ({f['format']})" if mixed else ""
        lines.append(f"source {f['name']}{read_as}: {f['documents']:,} documents, {f['tokens']:,} tokens; per mixture epoch "
                     f"{f['mixture_tokens']:,} tokens, {asked}, {f['epochs_per_mixture_epoch']:.2f}x its data{epochs}")
    return lines


def missed_shares(figures: list[dict]) -> list[str]:
    """Warnings for sources whose share landed farther than ``SHARE_TOLERANCE`` from the asked one."""
    return [
        f"source {f['name']}: share {f['share']:.1%} reached, {f['share_asked']:.1%} asked: its documents are too "
        "few or too long to land closer (split them, e.g. data.too_long: split with a lower data.max_length)"
        for f in figures if f["share_asked"] is not None and abs(f["share"] - f["share_asked"]) > SHARE_TOLERANCE
    ]


def planned_mixture(cfg: DataSettings, train_store: Path, seed: int, paired: bool, formats: list[str] | None = None) -> dict:
    """``plan``'s view of a mixture in the token cache: its tokens and sequences per epoch, and each source's
    figures (empty for one source); ``formats``: what each source was read as."""
    specs = cfg.sources()
    if len(specs) < 2:
        return {}
    store = TokenStore(train_store)
    index = mixture_indices(store, specs, seed, paired)
    figures = figures_dicts(mixture_figures(store, specs, index, paired, formats))
    return {"mixture_tokens": sum(f["mixture_tokens"] for f in figures),
            "mixture_sequences": sum(f["mixture_documents"] for f in figures), "sources": figures}


def planned_epochs(data: dict, steps: int | None, rows_per_step: int, packed: bool, max_length: int) -> None:
    """Each source's epochs over a planned run of ``steps`` (``data["sources"]``), as ``plan.run_steps`` counts rows."""
    if "sources" not in data or not steps:
        return
    rows = data["mixture_sequences"] if not packed else -(-data["mixture_tokens"] // max_length)
    add_run_epochs(data["sources"], rows, steps * rows_per_step)


def describe_planned(data: dict) -> list[str]:
    """``plan``'s lines for a mixture: its tokens per epoch, then one per source."""
    if "sources" not in data:
        return []
    return [f"mixture: {data['mixture_tokens']:,} tokens per epoch", *describe_mixture(data["sources"])]
