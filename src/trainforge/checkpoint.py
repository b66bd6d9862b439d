"""Checkpoints that are complete or invisible.

A checkpoint is written into a hidden temporary directory, every file is flushed to disk,
and only then is the directory renamed to ``step-NNNNNNNN``; the ``latest`` pointer moves
after that, and old checkpoints are pruned last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STEP_PREFIX = "step-"
LATEST = "latest"
COMPLETE_MARKER = "meta.json"  # written last inside the temporary directory


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def atomic_write_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_dir)``, flush everything, then rename ``tmp_dir`` to ``target``.

    An existing ``target`` is replaced only after the new one is complete.
    """
    target = Path(target)
    tmp = target.parent / f".{target.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old"
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def save_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> Path:
    """Write ``root/step-NNNNNNNN`` atomically, move ``latest`` to it, prune to ``keep_last``."""
    root.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        torch.save(state, tmp / "state.pt")
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"step": step, **meta}, indent=2))

    path = atomic_write_dir(root / step_dir_name(step), write)
    pointer_tmp = root / f".{LATEST}.tmp"
    pointer_tmp.write_text(path.name + "\n")
    os.replace(pointer_tmp, root / LATEST)  # atomic: readers see the old or the new name, never half
    prune_checkpoints(root, keep_last)
    return path


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (temporary and partial ones are ignored)."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / COMPLETE_MARKER).is_file() and (p / "state.pt").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the newest)."""
    for old in complete_checkpoints(root)[: -max(1, keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
