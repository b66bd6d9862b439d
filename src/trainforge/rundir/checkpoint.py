"""Checkpoints that are complete or invisible.

A checkpoint is written into a hidden temporary directory named after the writing process
(``.step-NNNNNNNN.tmp-HOST-PID-RANDOM``, see rundir/atomic.py), every file is flushed to disk,
and only then is the directory renamed to ``step-NNNNNNNN``; the ``latest`` pointer moves
after that, and old checkpoints are pruned last. ``meta.json`` is written last inside the
temporary directory and records the size of every file, so a directory that was cut short
(copied by hand, a disk that lost data) is recognized and skipped with a reason.

``meta.json`` also records a CRC-32 of ``state.pt``, computed on the bytes as ``torch.save``
writes them (no second read of the file while training waits). ``verify_checkpoint`` reads the
file once, streaming, and compares: a file damaged in place (its size unchanged) is skipped on
resume like a truncated one. The FSDP shard files (``sharded/``, written by all ranks through
``torch.distributed.checkpoint``) are recorded by size only: hashing them would mean re-reading
them or a custom storage writer. Checkpoints written before checksums existed (``files`` maps
names to sizes) are still accepted, by size.

Resume discovery scans the directories rather than trusting ``latest``: a process killed
between the rename and the pointer update leaves a complete checkpoint the pointer misses.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .atomic import OLD_MARK, TMP_MARK, atomic_write_dir, process_tag, staging_dir  # noqa: F401 (re-exported)

STEP_PREFIX = "step-"
LATEST = "latest"
STATE_FILE = "state.pt"
COMPLETE_MARKER = "meta.json"  # written last inside the temporary directory
# The checksum of each file. CRC-32, not a cryptographic hash: it guards against damage, not against
# tampering (whoever can rewrite state.pt can rewrite meta.json beside it), it catches every error
# burst of up to 32 bits (so any single flipped byte) and is the fastest: on a 200 MB buffer here
# zlib.crc32 ran at ~1.96 GB/s, hashlib sha256 at ~1.13 GB/s, blake2b at ~0.56 GB/s; torch.save of a
# 200 MB tensor took 0.33 s through the hashing writer against 0.22 s without it (page cache).
CHECKSUM = "crc32"
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint directory and its meta.json."""

    path: Path
    step: int
    meta: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def save_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
    write_shards: Callable[[Path], None] | None = None,
    staging: Path | None = None,
) -> Path:
    """Write ``root/step-NNNNNNNN`` atomically, move ``latest`` to it, prune to ``keep_last``.

    ``write_shards(tmp)``: files written into the staging directory before ``state.pt`` (sharded
    weights that all ranks write together); they are covered by ``meta.json`` like ``state.pt``.
    ``staging``: the temporary directory (default: one named after this process).
    """
    root.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        if write_shards is not None:
            write_shards(tmp)
        checksums = _write_state(tmp, state) or {}
        _write_meta(tmp, {"step": step, **meta}, checksums)

    path = atomic_write_dir(root / step_dir_name(step), write, staging)
    _move_latest(root, path.name)
    prune_checkpoints(root, keep_last)
    return path


class _ChecksumWriter:
    """A binary file that computes the CRC-32 and the length of what is written through it."""

    def __init__(self, file: Any):
        self.file, self.crc, self.bytes = file, 0, 0
        self.name = getattr(file, "name", None)

    def __repr__(self) -> str:  # names the file, as the file object itself does (logs, hooks on torch.save)
        return f"<checksummed {self.file!r}>"

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)  # releases the GIL on large buffers
        self.bytes += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def record(self) -> dict[str, Any]:
        return {"bytes": self.bytes, CHECKSUM: f"{self.crc:08x}"}


def _write_state(tmp: Path, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Write ``state.pt``; returns its size and checksum, taken from the bytes on their way to the file."""
    with open(tmp / STATE_FILE, "wb") as f:
        out = _ChecksumWriter(f)
        torch.save(state, out)
    return {STATE_FILE: out.record()}


def _write_meta(tmp: Path, meta: dict[str, Any], checksums: dict[str, dict[str, Any]] | None = None) -> None:
    """The completion marker: written last, it records the size every file must have, and the checksum
    of those whose bytes were hashed as they were written (``checksums``)."""
    files: dict[str, dict[str, Any]] = {}
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            name, size = str(f.relative_to(tmp)), f.stat().st_size
            known = (checksums or {}).get(name)
            files[name] = known if known is not None and known["bytes"] == size else {"bytes": size}
    record = {**meta, "files": files, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (tmp / COMPLETE_MARKER).write_text(json.dumps(record, indent=2))


def _expected_size(record: Any) -> int:
    """A file's size in ``meta.json``: ``{"bytes": N, ...}``, or a bare N (before checksums)."""
    return int(record["bytes"]) if isinstance(record, dict) else int(record)


def file_checksum(path: Path) -> str:
    """The CRC-32 of a file, read once in large chunks."""
    crc, buf = 0, bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def verify_checkpoint(info: CheckpointInfo) -> str | None:
    """Why the checkpoint's files do not match the checksums in its ``meta.json`` (None: they do, or
    none were recorded: see ``has_checksums``). Reads each checksummed file once."""
    for name, record in info.meta.get("files", {}).items():
        if not (isinstance(record, dict) and CHECKSUM in record):
            continue
        try:
            got = file_checksum(info.path / name)
        except OSError as e:
            return f"{name} cannot be read ({e})"
        if got != record[CHECKSUM]:
            return (
                f"{name} is damaged: its {CHECKSUM} is {got}, {COMPLETE_MARKER} recorded {record[CHECKSUM]} "
                "(same size, different bytes)"
            )
    return None


def has_checksums(info: CheckpointInfo) -> bool:
    """Whether ``meta.json`` records a checksum of ``state.pt`` (checkpoints of older versions do not)."""
    record = info.meta.get("files", {}).get(STATE_FILE)
    return isinstance(record, dict) and CHECKSUM in record


def _move_latest(root: Path, name: str) -> None:
    pointer_tmp = root / f".{LATEST}{TMP_MARK}{process_tag()}"
    pointer_tmp.write_text(name + "\n")
    os.replace(pointer_tmp, root / LATEST)  # atomic: readers see the old or the new name, never half


def inspect_checkpoint(path: Path) -> CheckpointInfo | str:
    """The checkpoint at ``path``, or why it is not a complete one."""
    path = Path(path)
    meta_file, state_file = path / COMPLETE_MARKER, path / STATE_FILE
    if not meta_file.is_file():
        return f"no {COMPLETE_MARKER} (an unfinished or partial copy)"
    try:
        meta = json.loads(meta_file.read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{COMPLETE_MARKER} is unreadable ({e})"
    if not isinstance(meta.get("files", {}), dict):  # a list or a string there would fail the size checks below
        return f"{COMPLETE_MARKER} is unreadable (its \"files\" is not an object)"
    if not state_file.is_file():
        return f"{STATE_FILE} is missing"
    for name, record in meta.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        try:
            expected = _expected_size(record)
        except (ValueError, KeyError, TypeError) as e:
            return f"{COMPLETE_MARKER} is unreadable (files.{name}: {e!r})"
        size = f.stat().st_size
        if size != expected:
            return f"{name} is truncated ({size:,} of {expected:,} bytes)"
    return CheckpointInfo(path, step, meta)


def scan_checkpoints(root: Path) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]:
    """(complete checkpoints oldest first, [(directory, reason)] of visible ones that are not)."""
    if not Path(root).is_dir():
        return [], []
    complete, skipped = [], []
    for p in sorted(Path(root).iterdir(), key=lambda p: p.name):
        if not (p.is_dir() and p.name.startswith(STEP_PREFIX)):
            continue  # hidden temporaries (".step-*.tmp") are invisible by design
        found = inspect_checkpoint(p)
        if isinstance(found, CheckpointInfo):
            complete.append(found)
        else:
            skipped.append((p, found))
    return sorted(complete, key=lambda c: c.step), skipped


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (temporary and partial ones are ignored)."""
    return [c.path for c in scan_checkpoints(root)[0]]


def load_checkpoint_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """``state.pt`` of a checkpoint, on the CPU (plain tensors and containers only: no pickled code); ``mmap``:
    its tensors map the file instead of being read into memory."""
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True, mmap=mmap)


def recover_hidden(root: Path) -> list[str]:
    """Clean up after a process that died while saving; returns what was done, for the log.

    Call it only as the run directory's one writer (the lease holder): ``.step-N.tmp-TAG`` (a
    save that never finished) is deleted. ``.step-N.old-TAG`` is a complete checkpoint parked
    while being replaced: it is put back when the replacement is missing.
    """
    done: list[str] = []
    if not Path(root).is_dir():
        return done
    for p in sorted(Path(root).iterdir()):
        name = p.name
        if not name.startswith("."):
            continue
        if name.startswith(f".{STEP_PREFIX}") and (TMP_MARK in name or name.endswith(".tmp")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed unfinished {name}")
        elif name.startswith(f".{STEP_PREFIX}") and (OLD_MARK in name or name.endswith(".old")) and p.is_dir():
            target = p.with_name(name[1:].split(OLD_MARK)[0].removesuffix(".old"))
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.rename(target)
                done.append(f"restored {target.name}")
        elif name.startswith(f".{LATEST}.tmp"):
            p.unlink(missing_ok=True)
    return done


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the newest)."""
    for old in complete_checkpoints(root)[: -max(1, keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
