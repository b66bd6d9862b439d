"""Activation offload: the checkpointed layers' inputs kept in host memory (``train.activation_offload``).

With activation checkpointing every decoder layer keeps only its input for backward (the boundary
between layers): at long lengths, layers x tokens x hidden values on the device. torch's non-reentrant
checkpoint saves those inputs as saved tensors before it installs its own hooks for the layer's
inside, so ``saved_tensors_hooks`` entered around each checkpointed call see exactly the boundaries
(everything inside the layer goes through the checkpoint's hooks, which drop it for recompute).

On CUDA the pack hook copies a boundary into pinned host memory on a side stream (the copy overlaps
the layer's compute; ``record_stream`` keeps the device memory from being reused before the copy has
read it), and the device tensor is freed as soon as the forward lets go of it; the unpack hook, when
backward recomputes that layer, waits for the copy and brings it back. On a CPU there is no other
memory to move to: the run installs nothing (and says so once); ``BoundaryOffload(copy=True)``
copies anyway, so that tests can check the path on a CPU.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

MIN_BYTES = 1 << 16  # boundaries smaller than 64 KiB stay where they are: the copy costs more than it frees


@dataclass
class _Packed:
    device: torch.device
    host: Any  # the host copy (pinned on CUDA); the traced stand-in: the boundary's (shape, stride, dtype)
    ready: Any = None  # the CUDA event after which ``host`` holds the copy
    below: "weakref.ref[_Packed] | None" = None  # the boundary packed just before (the layer below): fetched early
    fetched: torch.Tensor | None = None  # its device copy, brought back ahead of its layer's recompute
    fetched_ready: Any = None  # the CUDA event after which ``fetched`` holds it
    used: bool = False


class BoundaryOffload:
    """Pack/unpack hooks that keep saved tensors in host memory, and what they moved (``count``, ``bytes``).

    Backward recomputes the layers top down, so when a layer's boundary comes back, the one below it is next:
    its copy back starts then (``prefetch``, on the side stream), and overlaps this layer's recompute and
    backward instead of waiting at the start of its own. The cost is one more boundary on the device during
    backward (the plan's stand-in does the same, so it is priced)."""

    def __init__(self, device: torch.device, copy: bool = False, min_bytes: int = MIN_BYTES, prefetch: bool = True) -> None:
        self.device, self.copy, self.min_bytes, self.prefetch = device, copy, min_bytes, prefetch
        self.count = self.bytes = self.prefetched = 0
        # the latest boundary packed: the next one's ``below``. Weak, as the links are: a forward that raised (an
        # out-of-memory retry) frees its graph and its boundaries with it, so the next forward links nothing stale
        self._last: weakref.ref[_Packed] | None = None
        # the side stream the copies run on, overlapped with the forward's compute and the backward's
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def pack(self, t: torch.Tensor) -> Any:
        size = t.numel() * t.element_size()
        if size < self.min_bytes or (t.device.type != "cuda" and not self.copy):
            return t
        self.count, self.bytes = self.count + 1, self.bytes + size
        packed = self._store(t)
        last = self._last() if self._last is not None else None
        packed.below = weakref.ref(last) if last is not None and not last.used else None  # a new forward: nothing below
        self._last = weakref.ref(packed)
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if packed.fetched is not None:  # brought back early: wait for that copy only
            t, packed.fetched = packed.fetched, None
            if packed.fetched_ready is not None:
                current = torch.cuda.current_stream(packed.device)
                current.wait_event(packed.fetched_ready)
                t.record_stream(current)  # made on the side stream, used and freed on this one
        else:
            t = self._load(packed, early=False)
        packed.used = True
        if self._last is not None and self._last() is packed:
            self._last = None  # backward reached the top boundary: the next forward links afresh
        below = packed.below() if packed.below is not None else None
        packed.below = None
        if self.prefetch and below is not None and not below.used and below.fetched is None:
            below.fetched = self._load(below, early=True)
            self.prefetched += 1
        return t

    def _store(self, t: torch.Tensor) -> _Packed:
        """``t``'s host copy: on CUDA pinned, copied on the side stream once the compute that wrote it is done."""
        if t.device.type != "cuda":
            return _Packed(t.device, t.detach().clone())  # a CPU "host copy": the same path, for tests
        current = torch.cuda.current_stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(current)  # the copy reads t once the compute that wrote it is done
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            ready = self.stream.record_event()
        t.record_stream(self.stream)  # the allocator must not hand t's memory out before the copy has read it
        return _Packed(t.device, host, ready)

    def _load(self, packed: _Packed, early: bool) -> torch.Tensor:
        """The boundary back on its device: ``early`` on the side stream (a prefetch, its event in ``fetched_ready``),
        else on the compute stream (ordered there: no host sync)."""
        if packed.ready is None:
            return packed.host.clone() if early else packed.host  # the CPU path: a copy, so that a prefetch is one
        if not early:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(packed.ready)
            return packed.host.to(packed.device, non_blocking=True)
        self.stream.wait_event(packed.ready)
        with torch.cuda.stream(self.stream):
            t = packed.host.to(packed.device, non_blocking=True)
            packed.fetched_ready = self.stream.record_event()
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class TracedOffload(BoundaryOffload):
    """The plan's stand-in on fake tensors: a packed boundary keeps only its shape (nothing on the device),
    and bringing it back allocates it again (the copy back, counted in backward, the prefetch's too)."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        super().__init__(torch.device("cpu"), copy=True, min_bytes=min_bytes)  # packs fake CPU tensors as a GPU's

    def _store(self, t: torch.Tensor) -> _Packed:
        return _Packed(t.device, (tuple(t.shape), tuple(t.stride()), t.dtype))

    def _load(self, packed: _Packed, early: bool) -> torch.Tensor:
        shape, stride, dtype = packed.host
        return torch.empty_strided(shape, stride, dtype=dtype)


def _offloaded(func: Callable, offload: BoundaryOffload, *args: Any, **kwargs: Any) -> Any:
    with offload.hooks():
        return func(*args, **kwargs)


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that run under activation checkpointing (transformers' ``GradientCheckpointingLayer``s switched on)."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True
            and callable(getattr(m, "_gradient_checkpointing_func", None))]


def install_offload(model: torch.nn.Module, offload: BoundaryOffload) -> int:
    """Run every checkpointed layer's checkpoint call inside ``offload``'s hooks; returns how many layers.
    Applied after ``enable_activation_checkpointing`` (it wraps the checkpoint function that sets)."""
    layers = [m for m in checkpointed_layers(model) if hasattr(m, "self_attn") or hasattr(m, "mlp")
              or type(m).__name__.endswith(("Layer", "Block"))]
    for layer in layers:
        func = layer._gradient_checkpointing_func
        original = getattr(func, "trainforge_original", func)  # installing twice wraps once
        wrapped = functools.partial(_offloaded, original, offload)
        wrapped.trainforge_original = original
        layer._gradient_checkpointing_func = wrapped
    return len(layers)
