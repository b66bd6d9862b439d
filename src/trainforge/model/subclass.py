"""A subclass of a module class with its ``forward`` replaced, made once per class: how trainforge swaps in its
fused LoRA layers and tiled MLPs without copying a module (``module.__class__`` is set to it)."""

from __future__ import annotations

from typing import Callable


def forward_subclass(cls: type, cache: dict[type, type], prefix: str, forward: Callable, kept_as: str, doc: str) -> type:
    """``cls``'s subclass named ``prefix + cls.__name__`` whose forward is ``forward``, with ``cls.forward`` kept as the
    attribute ``kept_as`` (the original the new forward falls back to); one per class, held in ``cache``."""
    if cls not in cache:
        cache[cls] = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward, kept_as: cls.forward, "__doc__": doc})
    return cache[cls]
