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
    "eval_s": ("evaluation", "evaluate fewer batches (train.eval_max_batches; auto sizes them to the run) or less often (train.eval_every)"),
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


def ledger_from_files(
    summary: dict[str, Any] | None, train: list[dict[str, Any]], events: list[dict[str, Any]], last_seen: float | None
) -> dict[str, float]:
    """Where a run's wall time went, from its files: summary.json's ``time`` when the run finished, else rebuilt
    from events.jsonl (start-up, evals, checkpoint pauses) and metrics.jsonl (data wait, loop time) for a run
    that stopped or was killed. ``last_seen``: unix time the run last wrote anything (ends its wall time)."""
    if summary and isinstance(summary.get("time"), dict):
        return {k: v for k, v in summary["time"].items() if isinstance(v, (int, float))}

    def total(kind: str, key: str) -> float:
        return sum(float(e.get(key) or 0.0) for e in events if e.get("event") == kind)

    data_wait, before = 0.0, 0.0
    for r in train:
        elapsed = float(r.get("elapsed_s") or 0.0)
        if elapsed > before:  # a resumed run's loop time goes on from its checkpoint's
            data_wait += float(r.get("data_wait_pct") or 0.0) / 100 * (elapsed - before)
        before = elapsed
    loop = float(train[-1].get("elapsed_s") or 0.0) if train else 0.0
    starts = [e for e in events if e.get("event") == "start" and isinstance(e.get("time"), (int, float))]
    wall = 0.0
    for i, start in enumerate(starts):  # each process that ran the run: from its start-up to its last word
        began = start["time"] - float(start.get("startup_s") or 0.0)
        upto = starts[i + 1]["time"] if i + 1 < len(starts) else float("inf")
        ends = [e["time"] for e in events if isinstance(e.get("time"), (int, float)) and start["time"] <= e["time"] < upto]
        if i == len(starts) - 1 and last_seen is not None:
            ends.append(last_seen)
        wall += max(ends, default=start["time"]) - began
    return {
        "startup_s": total("start", "startup_s"),
        "train_s": loop - data_wait,
        "data_wait_s": data_wait,
        "eval_s": total("eval", "seconds"),
        "checkpoint_s": total("checkpoint", "pause_s"),
        "wall_s": wall,
    }
