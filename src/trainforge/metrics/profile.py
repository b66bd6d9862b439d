"""Step-time breakdown (data, forward, backward, optimizer), where the device's time went (matmuls,
attention, optimizer, copies, ...; on a GPU how busy it was), and a torch profiler trace, on request."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch


class StepTimer:
    """Times named phases of a step. Inactive (free) except on profiled steps, where it
    synchronizes the device at each phase edge so GPU work is charged to its phase."""

    def __init__(self, device: torch.device):
        self.device = device
        self.active = False
        self.seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] += time.perf_counter() - start


# What a kernel or op is, by fragments of its lower-cased name; the first kind that matches wins.
# GPU names: cuBLAS (sm90_xmma_gemm_*, nvjet_*, ampere_*gemm*), CUTLASS, Flash (flash_fwd_kernel,
# fmha*), FlexAttention (triton_tem_fused_flex_attention), fused AdamW (multi_tensor_apply_kernel
# <...FusedAdamMathFunctor>), NCCL (ncclDevKernel_AllReduce_*); CPU names are aten's.
OP_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "gloo", "c10d")),
    ("copy", ("memcpy", "memset", "aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")),
    ("optimizer", ("adam", "multi_tensor", "aten::_foreach", "optimizer")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "varlen", "flex")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "wgmma", "scaled_mm", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::matmul", "aten::baddbmm", "aten::linear")),
)
TOP_OPS = 8


def op_kind(name: str) -> str:
    """The kind of a kernel or op by its name (``OP_KINDS``), else ``other`` (elementwise, norms, fused Triton kernels)."""
    low = name.lower()
    return next((kind for kind, fragments in OP_KINDS if any(f in low for f in fragments)), "other")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals (kernels on concurrent streams count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def time_split(timed: list[tuple[str, float]], wall_s: float, busy_s: float | None) -> dict:
    """From (name, seconds) of every kernel (or op) of a profiled step: the seconds by kind, the top ops,
    and the device's busy share of the step's wall time (``busy_s``: None on a CPU, where ops are the host's)."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for name, seconds in timed:
        by_kind[op_kind(name)] += seconds
        by_name[name] += seconds
    total = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_OPS]
    return {
        "op_seconds": total,
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [{"name": n[:160], "seconds": s, "share": s / total if total else 0.0} for n, s in top],
        "device_busy": min(busy_s / wall_s, 1.0) if busy_s is not None and wall_s > 0 else None,
    }


def device_kernels(events: list) -> list:
    """The CUDA kernels and copies among a profile's events, without the user annotations that kineto also
    puts on the device's timeline (``Optimizer.step#AdamW.step``, compile's ``## Call CompiledFxGraph ...
    ##``): each spans kernels already counted and the gaps between them, so counting it doubled their time
    and filled the host gaps of the busy share (on an H200 the optimizer read 24 ms where its kernels took 10)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def profiled_ops(prof: torch.profiler.profile, device_type: str) -> tuple[list[tuple[str, float]], float | None]:
    """(name, seconds) of what ran in a profile, and the device's busy seconds: on CUDA its kernels
    (each launch, with the union of their intervals); elsewhere the host's ops by self time, busy None."""
    if device_type == "cuda":
        kernels = device_kernels(prof.events())
        spans = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in kernels]
        return [(e.name, (b - a)) for e, (a, b) in zip(kernels, spans)], busy_seconds(spans)
    return [(a.key, a.self_cpu_time_total / 1e6) for a in prof.key_averages() if a.self_cpu_time_total > 0], None


def describe_split(split: dict) -> str:
    """``device busy 93%; matmul 61%, attention 14%, ...; top: name (share)`` for the console."""
    total = split["op_seconds"] or 1.0
    kinds = ", ".join(f"{k} {v / total:.0%}" for k, v in split["by_kind_s"].items() if v / total >= 0.01)
    where = "kernel" if split["device_busy"] is not None else "op"
    busy = f"device busy {split['device_busy']:.0%} of the step; " if split["device_busy"] is not None else ""
    top = split["top"][0] if split["top"] else None
    return busy + f"{where} time: {kinds}" + (f"; top {top['name'][:60]} ({top['share']:.0%})" if top else "")


class StepProfile:
    """One profiled step: activates the timer and records a profiler trace under ``trace_dir``."""

    def __init__(self, timer: StepTimer, step: int, trace_dir: Path):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if timer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.timer, self.step, self.trace = timer, step, trace_dir / f"step-{step:08d}.json"
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.split: dict = {}
        timer.seconds.clear()
        timer.active = True
        self.prof.__enter__()

    def finish(self) -> dict[str, float]:
        """Stop, write the trace (open it in Perfetto or chrome://tracing), return the phase breakdown;
        ``self.split`` then holds where the device's time went (``time_split``)."""
        self.prof.__exit__(None, None, None)
        self.timer.active = False
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.trace))
        phases = {f"{k}_s": v for k, v in self.timer.seconds.items()}
        timed, busy = profiled_ops(self.prof, self.timer.device.type)
        self.split = time_split(timed, sum(phases.values()), busy)
        return phases


NULL_TIMER = StepTimer(torch.device("cpu"))  # never activated: every phase() is a plain yield
