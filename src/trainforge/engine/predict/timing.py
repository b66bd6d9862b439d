"""Step time from a traced step's ops on a hardware profile: a roofline per op.

Each op takes the longer of its compute time (FLOPs over the profile's peak in the op's
precision, times the share of peak real kernels reach) and its memory time (bytes read and
written over the bandwidth, likewise), plus a fixed per-op overhead (Python, dispatcher,
kernel launch: eager PyTorch pays it on every op, and on small models it dominates).
A step is ``grad_accum`` forward/backward passes and one optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...hardware.profiles import HardwareProfile
from .trace import ATTENTION_OPS, StepTrace

_PRECISION_OF = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp32", "float8": "fp8"}


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, and where they go."""

    seconds: float
    compute_s: float  # ops bound by FLOPs
    memory_s: float  # ops bound by bytes moved
    overhead_s: float  # per-op fixed cost
    flops: float  # model FLOPs of the step (all micro-batches)
    tokens: int  # tokens of the step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def predict_step_time(
    trace: StepTrace, profile: HardwareProfile, grad_accum: int = 1, measured: dict[str, float] | None = None,
    attention_share: float = 1.0,
) -> StepTime:
    """Seconds per optimizer step of ``trace`` (one micro-batch + optimizer) on ``profile``.

    ``measured``: seconds per op key from ``measure_ops`` (this machine only); those ops take
    their measured time instead of the roofline's. ``attention_share``: the part of the traced
    (whole-row) attention the run's kernel computes (``document_attention_share``).
    """
    measured = measured or {}
    deep = _price(trace.ops, profile, grad_accum, measured, attention_share)
    if trace.fewer_ops is None:
        totals = deep
    else:  # a deep model traced shallow: add the per-layer difference for the layers not traced
        shallow = _price(trace.fewer_ops, profile, grad_accum, measured, attention_share)
        totals = {k: deep[k] + trace.extrapolate * (deep[k] - shallow[k]) for k in deep}
    seconds = totals["compute"] + totals["memory"] + totals["overhead"]
    return StepTime(seconds, totals["compute"], totals["memory"], totals["overhead"], totals["flops"], trace.tokens * grad_accum)


def document_attention_share(document_tokens: float | None, row_tokens: int) -> float:
    """The part of a whole row's causal attention a document-masked kernel (varlen, flex) computes on
    packed rows: each token attends within its own document, so a row full of documents of lengths l
    costs sum(l^2) against the whole row's L^2, i.e. the token-weighted mean document length
    sum(l^2) / sum(l) over L (``document_tokens``). 1 when unknown."""
    if not document_tokens or row_tokens <= 0:
        return 1.0
    return min(1.0, document_tokens / row_tokens)


def _price(ops: list, profile: HardwareProfile, grad_accum: int, measured: dict[str, float],
           attention_share: float = 1.0) -> dict[str, float]:
    totals = {"compute": 0.0, "memory": 0.0, "overhead": 0.0, "flops": 0.0}
    if attention_share != 1.0:
        ops = [replace(op, flops=op.flops * attention_share) if op.name in ATTENTION_OPS else op for op in ops]
    roofline = [(op, *_roofline(op, profile)) for op in ops]
    # ops left unmeasured (too large to replay, or out of time) take the roofline scaled by how far
    # the measured ones were from it: on a CPU, small ops run far below the probes' rates
    timed = [(measured[op.key], max(c, m)) for op, c, m in roofline if op.key in measured]
    scale = sum(t for t, _ in timed) / max(sum(r for _, r in timed), 1e-12) if timed else 1.0
    for op, compute, memory in roofline:
        repeat = 1 if op.phase == "optimizer" else grad_accum
        key = "compute" if compute >= memory else "memory"
        seconds = measured.get(op.key, scale * max(compute, memory))
        if op.key in measured and op.name in ATTENTION_OPS:
            seconds *= attention_share  # replayed over the whole row; the run's kernel does its documents' share
        totals[key] += repeat * seconds
        totals["overhead"] += repeat * profile.op_overhead_s
        totals["flops"] += repeat * op.flops
    return totals


def _roofline(op, profile: HardwareProfile) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one op on ``profile``."""
    peak = profile.peak_flops(_PRECISION_OF.get(op.dtype, "fp32")) * profile.matmul_efficiency
    return (op.flops / peak if op.flops and peak else 0.0), op.bytes / (profile.bandwidth_gbs * 1e9 * profile.bandwidth_efficiency)


REPLAY_BYTES_LIMIT = 256 * 2**20  # larger ops are not replayed (memory, time): the roofline prices them
CACHE_SWEEP_BYTES = 32 * 2**20  # larger than the last-level cache share of a few cores


def measure_ops(trace: StepTrace, budget_s: float = 20.0, threads: int | None = None) -> dict[str, float]:
    """Seconds per distinct op of ``trace``, measured by running each once more on real random
    tensors of its shapes on this CPU, with cold caches as in a real step (each timed call comes
    after sweeping a buffer larger than the caches; best of 2 after a warm-up). Repeated layers
    share keys, so a deep model costs little more than one layer. Stops after ``budget_s``.
    ``threads``: time with this many threads (a process of a data-parallel job gets its share)."""
    import time

    import torch

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    sweep = torch.empty(CACHE_SWEEP_BYTES // 4)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _replay(trace, seconds, sweep, start, budget_s)
    finally:
        torch.set_num_threads(before)
    return seconds


def _replay(trace: StepTrace, seconds: dict[str, float], sweep, start: float, budget_s: float) -> None:
    import time

    import torch
    from torch.utils._pytree import tree_map_only

    from .trace import TensorSpec

    with torch.no_grad():
        for op in trace.ops:
            if op.key in seconds or op.func is None or op.bytes > REPLAY_BYTES_LIMIT:
                continue
            if time.perf_counter() - start > budget_s:
                break
            try:
                args, kwargs = tree_map_only(TensorSpec, TensorSpec.materialize, op.args)
                op.func(*args, **kwargs)
                best = float("inf")
                for _ in range(2):
                    sweep.add_(1.0)  # evict the inputs: in a step, other ops ran in between
                    t = time.perf_counter()
                    op.func(*args, **kwargs)
                    best = min(best, time.perf_counter() - t)
                seconds[op.key] = best
            except Exception:  # an op that needs real values (or a view of an input): priced by the roofline
                continue
