"""`trainforge plan --measure`: real steps at the planned settings on this machine, longest rows
first, in a fresh process, beside what plan predicted (tools/plan.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ..stop import Interrupted, StopRequest
from ..hardware.profiles import GIB
from .bench import as_measuring_child, bench_overrides, wait_for_variant


def measure(
    config_path: str | None, overrides: list[str], plan: dict[str, Any], steps: int = 5, warmup: int = 2
) -> dict[str, Any]:
    """Run real steps at the planned settings on this machine, longest rows first, in a fresh process
    (its own peak memory): live tensor peak of a steady-state step (every tensor counted as it is
    allocated and freed), the process peak (RSS on a CPU; allocated and reserved on a GPU), tokens/s."""
    import multiprocessing
    import tempfile

    chosen = {d["setting"]: d["choice"] for d in plan["decisions"]}
    # every setting plan decided, so the steps are the planned ones: left to auto, the run would decide its levers and
    # heap again from its own reading of this process's memory, and near a cap could take another (a tiled MLP)
    decided = ("micro_batch_size", "activation_checkpointing", "tiled_mlp", "activation_offload", "compact_heap")
    settings = [f"train.{key}={chosen[key]}" for key in decided if key in chosen]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workdir = tempfile.mkdtemp(prefix="trainforge-plan-")
    try:
        proc = ctx.Process(target=_measure_child, args=(config_path, [*overrides, *settings], steps, warmup, workdir, queue))
        with StopRequest("stopping the measurement (its steps are cut short: nothing measured)", quick=True) as stop:
            proc.start()
            result = wait_for_variant(proc, queue, stop)
        if result is None:
            raise Interrupted(f"plan --measure stopped by {stop.name}: nothing measured; run it again", stop.name)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _measure_child(config_path: str | None, overrides: list[str], steps: int, warmup: int, workdir: str, queue) -> None:
    try:
        queue.put(measure_steps(config_path, overrides, steps, warmup, Path(workdir), as_measuring_child()))
    except BaseException as e:  # the parent reports it
        queue.put({"error": f"{type(e).__name__}: {e}"})


def measure_steps(
    config_path: str | None, overrides: list[str], steps: int, warmup: int, workdir: Path, stop: StopRequest | None = None
) -> dict[str, Any]:
    """In this process: one traced steady-state step on the longest rows, then timed steps (``stop``: see open_run)."""
    from rich.console import Console

    from ..config.run import load_config
    from ..engine.predict.trace import StepTracer
    from ..engine.trainer import open_run, probe_step, rewind_data, train_loop
    from ..hardware.device import peak_memory_bytes
    from ..metrics.console import ConsoleReporter
    from ..metrics.tracker import read_metrics

    cfg = load_config(config_path, [*overrides, *bench_overrides(warmup, steps, workdir, False), "log.report_to=[]"])
    with open_run(cfg, workdir / "run", ConsoleReporter(Console(quiet=True)), resume="never", stop=stop) as run:
        rewind_data(run, longest_first=True)
        probe_step(run)  # creates the optimizer state: the traced step is a steady-state one
        rewind_data(run)
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)
        train_loop(run, warmup)
        train_loop(run)
        # read before the counted steps below: the profiler's records and the tracer's are no part of a run's memory
        process_peak = peak_memory_bytes(run.device)  # peak RSS on a CPU
        gpu = gpu_process_peak(run.device) if run.device.type == "cuda" else {}
        rewind_data(run)
        allocated = allocated_step_peak(run)  # the same longest-rows step, counted apart from the tracer
        rewind_data(run)
        tracer = StepTracer()
        tracer.track_training_state(run.model, run.optimizer, run.params)
        with tracer:
            probe_step(run)
        tracer.close()
        tracer.ops.clear()
    rec = [r for r in read_metrics(run.out / "metrics.jsonl") if "loss" in r][-1]
    return {
        "tokens_per_s": rec["tokens_per_s"],
        "live_tensor_peak_bytes": tracer.peak,
        "live_tensor_parts": tracer.peak_parts,
        **allocated,
        "process_peak_bytes": process_peak,
        **gpu,
    }


def allocated_step_peak(run) -> dict[str, Any]:
    """One step on the next batches measured by the allocator, not by the tracer: on a GPU the caching
    allocator's ``max_memory_allocated``; on a CPU the bytes of every tensor storage alive at the step's start
    (found by the garbage collector) plus the peak of c10's CPU allocator events during it (torch.profiler's
    memory records: each allocation and free as it happens)."""
    import gc

    from ..engine.trainer import probe_step

    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
        probe_step(run)
        torch.cuda.synchronize(run.device)
        return {"allocated_step_peak_bytes": int(torch.cuda.max_memory_allocated(run.device)),
                "allocated_step_measure": "torch.cuda.max_memory_allocated"}
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
                continue
            storages[st.data_ptr()] = st.nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        probe_step(run)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return {"allocated_step_peak_bytes": sum(storages.values()) + peak,
            "allocated_step_measure": "live storages at the step's start + c10 CPU allocator events (torch.profiler)"}


def gpu_process_peak(device: torch.device) -> dict[str, int]:
    """What the card had to hold for this run: the allocator's peak reserved memory plus what the
    device holds outside the allocator (CUDA context, library workspaces), read as total - free -
    reserved now. Comparable to plan's process peak, which adds the profile's context to its tensors.
    Memory of other processes on the same GPU would count as outside too: measure on an idle GPU."""
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))
    reserved = int(torch.cuda.max_memory_reserved(device))
    return {"reserved_peak_bytes": reserved, "outside_allocator_bytes": int(outside),
            "allocated_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "process_peak_bytes": reserved + int(outside)}


def render_measured(plan: dict[str, Any], measured: dict[str, Any], console) -> None:
    """Predicted beside measured: peak tensors, process peak, tokens/s."""
    from rich.table import Table

    if "error" in measured:
        console.print(f"[red]measure failed[/red]: {measured['error']}")
        return
    m, t = plan["memory"], plan["time"]
    table = Table(title="predicted vs measured (this machine, longest rows first)", title_justify="left")
    for col in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="right")
    rows = [
        ("peak tensors (GiB)", m["peak_tensor_bytes"] / GIB, measured["live_tensor_peak_bytes"] / GIB),
        ("peak tensors, by the allocator (GiB)", m["peak_tensor_bytes"] / GIB, measured["allocated_step_peak_bytes"] / GIB),
        ("process peak (GiB)", m["peak_process_bytes"] / GIB, measured["process_peak_bytes"] / GIB),
        ("tokens/s", t["tokens_per_s"], measured["tokens_per_s"]),
    ]
    for name, p, q in rows:
        table.add_row(name, f"{p:,.3f}" if p < 100 else f"{p:,.0f}", f"{q:,.3f}" if q < 100 else f"{q:,.0f}", f"{q / p:.2f}" if p else "-")
    console.print(table)
