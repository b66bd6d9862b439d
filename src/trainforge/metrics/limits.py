"""What limited a run: the seconds it spent on anything but training, ranked, each with the one change to make.

The same ranking serves the end of a run (``summary.json`` ``limits``, the console, ``report``) and
``trainforge doctor`` on a finished or crashed run's files, so both say the same thing.
"""

from __future__ import annotations

from typing import Any

from .thresholds import limit

# what each part of the wall time is, and what to do when it is large
CAUSES: dict[str, tuple[str, str]] = {
    "data_wait_s": ("data wait", "the loop waited for batches: keep data.cache_dir on a local disk, use packing, run on a quieter host"),
    "eval_s": ("evaluation", "set train.eval_max_batches: auto (sized to the run) or evaluate less often (train.eval_every)"),
    "checkpoint_s": ("checkpoint pauses", "set checkpoint.async: true or save less often (checkpoint.every_minutes / every_steps)"),
    "startup_s": ("start-up", "imports, probes, tokenizer, data and model before step 1: a second run reuses the token cache and the probes"),
    "compile_s": ("compiling", "short runs do not pay for it: train.compile: auto decides from measured history, false turns it off"),
    "end_s": ("the end", "final/ written, report and sample: log.sample_prompt: null skips the sample"),
    "skipped_s": ("skipped steps", "steps thrown away for a non-finite loss or gradient: lower optim.lr or raise optim.warmup_steps"),
}


def rank_limits(parts: dict[str, float], wall_s: float) -> list[dict[str, Any]]:
    """``parts``: seconds per key of ``CAUSES``; the causes above ``limit_min_pct`` of ``wall_s``, largest first,
    as ``{"cause", "seconds", "share", "advice"}``."""
    floor = limit("limit_min_pct") / 100 * wall_s
    ranked = sorted(((k, v) for k, v in parts.items() if k in CAUSES and v and v > floor), key=lambda kv: -kv[1])
    return [
        {"cause": CAUSES[k][0], "seconds": round(v, 2), "share": round(v / max(wall_s, 1e-9), 4), "advice": CAUSES[k][1]}
        for k, v in ranked
    ]


def describe_limits(limits: list[dict[str, Any]], wall_s: float, train_s: float) -> str:
    """One short paragraph: the wall time, the share that trained, and each limit with its change."""
    head = f"what limited this run ({wall_s:.1f}s wall, {train_s / max(wall_s, 1e-9):.0%} of it training steps)"
    if not limits:
        return f"{head}: nothing above {limit('limit_min_pct'):g}% of the wall time besides training"
    items = "; ".join(f"{x['cause']} {x['share']:.0%} ({x['seconds']:.1f}s): {x['advice']}" for x in limits)
    return f"{head}: {items}"
