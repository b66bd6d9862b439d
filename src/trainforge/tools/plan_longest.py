"""``trainforge plan CONFIG --longest``: the longest ``data.max_length`` that fits at micro-batch 1 with the
run's method and levers, on this machine or a profile, and what each lever buys (engine/predict/longest.py)."""

from __future__ import annotations

from typing import Any

from ..config.run import RunConfig
from ..engine.predict.fit import FIT_MARGIN
from ..engine.predict.longest import Longest, auto_length, lever_table, longest_length, run_levers
from ..engine.predict.trace_cache import reusing_traces
from ..hardware.profiles import GIB
from .plan import plan_precision, plan_tokenizer, resolve_profile


def _row(found: Longest, cfg: RunConfig, profile) -> dict[str, Any]:
    from ..engine.predict.fit import heap_is_compact
    from ..engine.predict.levers import with_levers

    compact = (found.memory.compact_heap if found.memory is not None  # a CPU's heap, as the prediction priced it
               else heap_is_compact(with_levers(cfg, found.levers), profile, found.levers.checkpointing))
    return {
        "levers": found.levers.describe() + (" + compact heap" if compact else ""),
        "longest": found.length,
        "predicted_gib": round(found.memory.process / GIB, 3) if found.memory else None,
        "beyond_gib": round(found.beyond.process / GIB, 3) if found.beyond else None,
        "capped": found.capped,
    }


def longest_plan(cfg: RunConfig, hardware: str = "this", world_size: int = 1, mode: str = "ddp") -> dict[str, Any]:
    """The longest length with the run's levers, and the table of levers (none, checkpointing, + tiled MLP,
    + offload), as one JSON-able dict."""
    profile, device = resolve_profile(hardware, cfg)
    precision, _ = plan_precision(cfg, profile, device)
    tokenizer = plan_tokenizer(cfg)
    with reusing_traces():  # data.max_length: auto at one row traces what the run's row of the table traced
        table = lever_table(cfg, tokenizer, precision, profile, FIT_MARGIN, world_size, mode)
        levers = run_levers(cfg, profile)
        mine = next((found for found in table if found.levers == levers), None)
        if mine is None:
            mine = longest_length(cfg, tokenizer, precision, profile, levers, FIT_MARGIN, world_size, mode)
        auto = auto_length(cfg, tokenizer, precision, profile, world_size, mode)
    return {
        "hardware": profile.name,
        "capacity_gib": round(profile.memory_bytes / GIB, 2),
        "margin": FIT_MARGIN,
        "precision": precision.name,
        "method": cfg.model.method,
        "configured_max_length": cfg.data.max_length,
        "run": _row(mine, cfg, profile),
        "auto": {"max_length": auto.length, "why": auto.why},  # what data.max_length: auto takes (its micro-batch and cap)
        "levers": [_row(found, cfg, profile) for found in table],
    }


def render_longest(result: dict[str, Any], console) -> None:
    """The table: each lever's longest length and its gain over the row before."""
    run = result["run"]
    budget = result["margin"] * result["capacity_gib"]
    console.print(
        f"[bold]longest data.max_length[/bold] at micro-batch 1 on {result['hardware']} ({result['capacity_gib']:.1f} GiB, "
        f"budget {result['margin']:.0%} = {budget:.1f} GiB), {result['method']}, {result['precision']}:"
    )
    console.print(f"  with the run's levers ({run['levers']}): [bold]{run['longest']:,}[/bold] tokens"
                  + (f" (capped: {run['capped']})" if run["capped"] else ""))
    console.print(f"  data.max_length: auto takes [bold]{result['auto']['max_length']:,}[/bold] ({result['auto']['why']})")
    console.print(f"  {'levers':<42} {'longest':>10} {'gain':>7} {'peak there':>11} {'+256 tokens':>12}")
    before = None
    for row in result["levers"]:
        gain = f"x{row['longest'] / before:.2f}" if before else ""
        peak = f"{row['predicted_gib']:.2f} GiB" if row["predicted_gib"] is not None else "-"
        beyond = f"{row['beyond_gib']:.2f} GiB" if row["beyond_gib"] is not None else "-"
        console.print(f"  {row['levers']:<42} {row['longest']:>10,} {gain:>7} {peak:>11} {beyond:>12}")
        before = row["longest"] or None
    console.print("  set data.max_length at most to the first line's length; train.tiled_mlp / activation_offload: auto "
                  "turn on what a length needs")


def print_longest(cfg: RunConfig, hardware: str, world_size: int, json_out: bool, console) -> None:
    """``plan --longest``: the search, printed as the table or as JSON."""
    import json

    found = longest_plan(cfg, hardware, world_size)
    if json_out:
        print(json.dumps(found, indent=2))
    else:
        render_longest(found, console)
