"""A CPU run's heap: glibc's malloc keeps freed blocks for reuse, and ``train.compact_heap`` makes it give them back.

By default glibc serves a block of up to 32 MiB from its heap once a block that size has been freed (its mmap
threshold rises with each large free), and a freed block only comes back to a later request it fits. A training
step allocates and frees tensors of many sizes that grow with the row length (a checkpointed layer's recompute
most of all), so the heap keeps what the sizes cannot share: on a 4-layer, 256-wide LoRA Llama at 13,056 tokens
with checkpointing and the tiled MLP, a step's live tensors peak at 0.30 GiB while the process peaks at 1.57-1.71
GiB; with the compact heap at 0.85 GiB (docs/long-context.md). Compact: every block of ``COMPACT_MMAP_THRESHOLD``
or more is mapped on its own and unmapped when freed (``mallopt(M_MMAP_THRESHOLD)``), so the process holds its live
tensors and little else. The cost is the page faults of the fresh mappings: a step 10-25% slower there.

No torch here: ``plan`` prices the heap from the config (predict/fit.py), a run's set-up applies it.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

COMPACT_MMAP_THRESHOLD = 1 << 20  # 1 MiB: every tensor that grows with the row length is mapped on its own
# auto: compact where the default heap's predicted peak passes this share of memory. glibc's default heap is not
# priced exactly: its rising mmap threshold serves blocks up to 32 MiB from a heap that keeps what it freed, and at
# long rows it held up to 1.1 GiB (+37%) over plan's figure (a 4 x 256 LoRA Llama at 16,384 tokens: 3.21-3.55 GiB
# after 1-4 steps against 2.59 predicted; compact: 2.36-2.42 against 2.49). Past this share such an error could pass
# the memory.
COMPACT_SHARE = 0.6  # (the error grew over a run's first steps: 0.6 x 1.37 = 0.82 of memory at most)
GLIBC_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's dynamic threshold stops here on 64-bit: what "off" restores
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")

_applied: list[bool] = [False]  # whether this process's threshold is trainforge's (then "off" restores it)


@cache
def _mallopt():
    """glibc's ``mallopt``, or None where the C library is another (musl, macOS, Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def users_threshold(environ: dict[str, str] | None = None) -> int | None:
    """The mmap threshold the user set for this process (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``'s
    ``glibc.malloc.mmap_threshold``), in bytes; None where they set none."""
    env = os.environ if environ is None else environ
    values = [env.get("MALLOC_MMAP_THRESHOLD_", "")]
    values += [t.split("=", 1)[1] for t in env.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.mmap_threshold=")]
    for value in values:
        try:
            return int(value.strip(), 0)
        except ValueError:
            continue
    return None


def compact_heap(setting: bool | str, device_type: str, checkpointing: bool, tiled_mlp: bool,
                 environ: dict[str, str] | None = None, predicted_share: float | None = None) -> tuple[bool, str]:
    """Whether a run's heap is compact, and why, from ``train.compact_heap`` (``auto``: on for a CPU step that
    needs a memory lever, activation checkpointing or the tiled MLP, or whose peak with the default heap is
    predicted past ``COMPACT_SHARE`` of memory (``predicted_share``, where a prediction was made), since only a run
    short of memory should pay for it). A user's own mmap threshold is left alone and decides (compact where it is
    at most 4 MiB)."""
    if device_type != "cpu":
        return False, "off: the CPU's heap (a GPU run's tensors live in the CUDA allocator)"
    users = users_threshold(environ)
    if users is not None:
        return users <= 4 * COMPACT_MMAP_THRESHOLD, f"as the environment's mmap threshold says ({users:,} bytes; left as set)"
    if _mallopt() is None:
        return False, f"off: it needs glibc's malloc ({platform.system()}, {platform.libc_ver()[0] or 'another C library'} here)"
    if setting != "auto":
        return bool(setting), "as configured"
    if checkpointing or tiled_mlp:
        levers = " and ".join(n for n, on in (("activation checkpointing", checkpointing), ("the tiled MLP", tiled_mlp)) if on)
        return True, f"on: the run needs memory levers ({levers}); freed blocks go back to the system (a step 10-25% slower)"
    if predicted_share is not None and predicted_share > COMPACT_SHARE:
        return True, (f"on: with glibc's default heap the step is predicted at {predicted_share:.0%} of memory, past "
                      f"{COMPACT_SHARE:.0%} (that heap can keep over 30% more than plan's figure at long rows); "
                      "freed blocks go back to the system (a step 5-25% slower)")
    return False, "off: the run needs no memory lever (a compact heap costs 10-25% of a step on a CPU)"


def apply_compact_heap(on: bool) -> None:
    """Make this process's heap compact (``on``), or give glibc's own behaviour back where trainforge changed it
    (``mallopt`` fixes the threshold from then on: 32 MiB is where glibc's rising one ends). Nothing without glibc
    or where the user set the threshold."""
    mallopt = _mallopt()
    if mallopt is None or users_threshold() is not None or (not on and not _applied[0]):
        return
    mallopt(M_MMAP_THRESHOLD, COMPACT_MMAP_THRESHOLD if on else GLIBC_MAX_MMAP_THRESHOLD)
    _applied[0] = on


@contextmanager
def heap_as(compact: bool) -> Iterator[None]:
    """This process's heap compact (or not) for the block, as it was after: ``plan`` times a step's ops with the heap
    the run will have, so a compact run's page faults are in its predicted step time."""
    was = _applied[0]
    apply_compact_heap(compact)
    try:
        yield
    finally:
        apply_compact_heap(was)
