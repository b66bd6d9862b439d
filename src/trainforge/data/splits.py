"""Splits in a directory laid out as a Hugging Face Hub dataset repository (a snapshot download).

The Hub names a file's split by its name or its directory (``huggingface/hub-docs``,
``datasets-file-names-and-splits.md``): ``data/<split>-00000-of-00002.parquet`` (what ``push_to_hub``
writes, any split name), else a ``train``/``validation``/``test`` keyword (or an equivalent: ``dev``,
``eval``, ...) delimited by non-word characters in the file name or a directory name
(``train.jsonl``, ``my_test_file.csv``, ``data/validation/shard_0.csv``). A directory whose files
fall in two or more splits is read as one split, ``train``, as ``datasets.load_dataset`` would load it
for training: the test rows never reach training (``sources.expand_paths``). Its metadata files
(``dataset_infos.json``, ...) are not data.
"""

from __future__ import annotations

import re
from pathlib import Path

TRAIN = "train"
# a repository's metadata beside its data files, which ``datasets.load_dataset`` never reads as rows
METADATA_FILES = frozenset({"config.json", "dataset_info.json", "dataset_infos.json"})
KEYWORDS = {
    "train": TRAIN, "training": TRAIN,
    "validation": "validation", "valid": "validation", "val": "validation", "dev": "validation",
    "test": "test", "testing": "test", "eval": "test", "evaluation": "test",
}
_SHARD = re.compile(r"^(?P<split>\w+?)-\d{5}-of-\d{5}")  # push_to_hub: <split>-00000-of-00002.<ext>
_WORDS = re.compile(r"[-._ 0-9]+")


def split_of(path: Path, root: Path) -> str | None:
    """The split a file of a Hub-style directory belongs to, by its name or a directory's; None: no split named."""
    shard = _SHARD.match(path.name)
    if shard:
        return shard["split"]
    parts = path.relative_to(root).parts
    for part in (Path(parts[-1]).stem, *reversed(parts[:-1])):
        for word in _WORDS.split(part.lower()):
            if word in KEYWORDS:
                return KEYWORDS[word]
    return None


def by_split(root: Path, files: list[Path]) -> dict[str, list[Path]]:
    """``files`` (below ``root``) grouped by split name; files whose names give none under ``""``."""
    splits: dict[str, list[Path]] = {}
    for f in files:
        splits.setdefault(split_of(f, root) or "", []).append(f)
    return splits
