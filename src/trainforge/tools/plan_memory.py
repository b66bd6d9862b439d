"""The plan's memory table: the predicted peak of one step by part; for a grpo run the learning step and the
rollout side by side (the rollout holds the sampler's KV cache), the larger of the two being the step's peak."""

from __future__ import annotations

from typing import Any

from ..engine.predict.fit import MemoryPrediction
from ..hardware.profiles import GIB


def rollout_facts(cfg: Any, memory: MemoryPrediction) -> dict[str, Any] | None:
    """The JSON of a grpo run's rollout phase (engine/predict/rollout_memory.py); None for other objectives."""
    if memory.rollout is None:
        return None
    phases = memory.phases
    return {"parts": memory.rollout, "tensors": phases["rollout"], "completions": memory.rollout_rows,
            "tokens_per_completion": cfg.data.max_length + cfg.rl.max_completion_length,
            "peak_phase": "rollout" if phases["rollout"] > phases["learning"] else "learning"}


def memory_table(m: dict[str, Any], h: dict[str, Any]):
    """The table of ``plan["memory"]`` (``m``) on ``plan["hardware"]`` (``h``): part | GiB, or for grpo part |
    learning | rollout, then the tensors at the peak and the process."""
    from rich.table import Table

    table = Table(title="predicted peak memory of one step (per process)", title_justify="left")
    table.add_column("part")
    rollout = m.get("rollout")

    def gib(value: int | None) -> str:
        return f"{value / GIB:.3f}" if value is not None else ""

    columns, peak = 1, 0  # the step's peak goes in the column of the phase that sets it
    if rollout is None:
        table.add_column("GiB", justify="right")
        for name, value in m["parts"].items():
            table.add_row(name, gib(value))
    else:
        table.add_column("learning GiB", justify="right")
        table.add_column(f"rollout GiB ({rollout['completions']} x {rollout['tokens_per_completion']} tokens)", justify="right")
        for name in [*m["parts"], *(k for k in rollout["parts"] if k not in m["parts"])]:
            table.add_row(name, gib(m["parts"].get(name)), gib(rollout["parts"].get(name)))
        table.add_row("tensors at the phase's peak", gib(sum(m["parts"].values())), gib(rollout["tensors"]))
        columns, peak = 2, 0 if rollout["peak_phase"] == "learning" else 1

    def at(value: int) -> list[str]:
        return [gib(value) if i == peak else "" for i in range(columns)]

    table.add_row("[bold]tensors at peak[/bold]", *(f"[bold]{v}[/bold]" if v else "" for v in at(m["peak_tensor_bytes"])))
    fixed, overhead = m.get("fixed_bytes", h["fixed_bytes"]) / GIB, m.get("allocator_overhead", h["allocator_overhead"])
    table.add_row(f"process (+{overhead:.0%} allocator, +{fixed:.2f} fixed)", *at(m["peak_process_bytes"]))
    if m.get("load_process_bytes"):
        table.add_row("process while loading the weights", *at(m["load_process_bytes"]))
    return table
