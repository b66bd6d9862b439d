"""MFU that can be believed: the peak it divides by follows a CPU's thread count, and no figure above
100% (a peak probe taken under load, the wrong GPU profile) is printed, logged or summed up."""

from __future__ import annotations

import dataclasses

from ..hardware.device import peak_flops
from ..metrics.thresholds import limit
from .run import Run, RunFacts


def _ratio(run: Run, tokens_per_s: float) -> float | None:
    return tokens_per_s * run.facts.flops_per_token / run.facts.peak_flops if run.facts.peak_flops else None


def window_mfu(run: Run, tokens_per_s: float) -> float | None:
    """This log window's MFU. Above 100% the peak is wrong: the advisor says so (once) and, on a CPU, measures
    it again before the record is written; an MFU still impossible is None."""
    mfu = _ratio(run, tokens_per_s)
    if mfu is None or mfu <= limit("impossible_mfu"):
        return mfu
    advice = run.advisor.impossible_mfu(run.step, mfu) if run.dist.is_main else None
    if advice is not None:
        run.reporter.warn(advice.message)
        run.metrics.event("advice", run.step, cause=advice.cause, message=advice.message, **advice.fields)
        if "new_peak_flops" in advice.fields:
            remeasured(run, advice.fields["new_peak_flops"])
            mfu = _ratio(run, tokens_per_s)
    return mfu if mfu is not None and mfu <= limit("impossible_mfu") else None


def remeasured(run: Run, peak: float) -> None:
    """The peak was measured again: MFU divides by it from now on, and so does this process's share of the
    whole run's (the earlier peak was wrong all along)."""
    run.facts = dataclasses.replace(run.facts, peak_flops=peak)
    c, before = run.counters, run.earlier
    c.peak_flop_s = before.get("peak_flop_s", 0.0) + (c.loop_time_s - before.get("loop_time_s", 0.0)) * peak


def follow_threads(run: Run) -> None:
    """The CPU thread count changed: the peak from here on is the matmul probe on the new count (cached per
    count). A run that went from 1 thread to 2 kept dividing by one thread's peak and printed MFU 168.6%."""
    if run.device.type == "cpu" and run.facts.peak_flops:
        peak = peak_flops(run.device, run.precision.name, run.cfg.data.cache_dir)[0] * run.dist.world_size
        run.facts = dataclasses.replace(run.facts, peak_flops=peak)


def run_mfu(tokens: int, facts: RunFacts, peak_flop_s: float) -> float | None:
    """The whole run's MFU for summary.json (the peak x seconds summed as the run went); None where unknown
    or impossible."""
    if not (facts.peak_flops and peak_flop_s):
        return None
    mfu = tokens * facts.flops_per_token / peak_flop_s
    return mfu if mfu <= limit("impossible_mfu") else None
