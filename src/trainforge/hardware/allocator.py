"""The CUDA caching allocator's settings: expandable segments unless the user chose otherwise.

With the default allocator, every new size class of activation (packed documents change shapes
from step to step; eval batches, OOM back-off and the loss's chunks add more) can leave a cached
block that later requests only partly reuse, so reserved memory climbs above what tensors hold.
That gap is what ends a run in an OOM hours in, while the allocated peak is well below the card.
Expandable segments map memory into one growing virtual range per stream instead, so freed
pages are reused whatever the sizes (torch's documentation recommends it when sizes vary).

The setting is read once, when CUDA's allocator first starts, so it is made before any CUDA work:
at the CLI's start and again at a run's set-up (for runs started from Python). A user's own
``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` is never touched. No torch import here:
the CLI calls this before it imports anything heavy.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib import metadata

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch 2.9+ documents the first, older reads the second
EXPANDABLE = "expandable_segments:True"
TRAINFORGE_SET_ENV = "TRAINFORGE_SET_ALLOC_CONF"  # marks a setting trainforge made (inherited by torchrun's workers)


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None, torch_version: str | None = None) -> None:
    """Ask for expandable segments in ``environ`` (default: this process's) unless the allocator is
    configured there already. Both variable names are set: torch 2.9 to 2.11 document
    ``PYTORCH_ALLOC_CONF`` but their CUDA allocator took ``expandable_segments`` only from the old
    name (pytorch#183387), and releases before 2.9 know only the old one. ROCm builds (their support
    differs by release) and CPU-only builds (no CUDA allocator) are left alone."""
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in ALLOC_CONF_VARS):
        return
    version = _torch_version() if torch_version is None else torch_version
    if not version or "rocm" in version or "+cpu" in version:
        return
    for name in ALLOC_CONF_VARS:
        env[name] = EXPANDABLE
    env[TRAINFORGE_SET_ENV] = "1"


def allocator_settings(environ: MutableMapping[str, str] | None = None, in_effect: bool | None = None) -> dict[str, object]:
    """What a run's CUDA allocator was asked for and by whom, for summary.json:
    ``{"settings": "expandable_segments:True", "set_by": "trainforge", "expandable_segments": True}``;
    ``set_by`` is "user" for the user's own variable, "torch" for none. ``in_effect``: whether the
    allocator reports expandable segments on (``expandable_segments_in_effect``), when known."""
    env = os.environ if environ is None else environ
    out: dict[str, object] = {"settings": "default", "set_by": "torch"}
    for name in ALLOC_CONF_VARS:
        if env.get(name):
            by = "trainforge" if env.get(TRAINFORGE_SET_ENV) == "1" and env[name] == EXPANDABLE else "user"
            out = {"settings": env[name], "variable": name, "set_by": by}
            break
    if in_effect is not None:
        out["expandable_segments"] = in_effect
    return out


def expandable_segments_in_effect() -> bool | None:
    """Whether CUDA's allocator runs with expandable segments (after it started), or None when torch
    does not say. Reads the allocator's own settings from a memory snapshot (no history is recorded)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None  # no allocator has started (a CUDA build on a machine without a GPU still answers the snapshot)
    try:
        settings = torch.cuda.memory._snapshot().get("allocator_settings", {})
    except (AssertionError, AttributeError, RuntimeError, TypeError):  # no CUDA, or a torch without the snapshot
        return None
    value = settings.get("expandable_segments") if isinstance(settings, dict) else None
    return bool(value) if value is not None else None
