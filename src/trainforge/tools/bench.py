"""`trainforge bench`: measure the training loop on a config, across variants, side by side.

Each variant runs the real training loop (the code `train` runs) in a fresh process, so
peak memory is the variant's own: warm-up steps, then the measured steps as one metrics
window (no checkpoints, no eval, no sample). Reported per variant: real tokens/s, MFU,
peak memory, data-wait share of step time, and the mean loss of the measured steps.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import queue as queue_module
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..config.run import ConfigError, RunConfig, load_config, parse_override
from ..config.errors import shown
from ..stop import STOP_SIGNALS, Interrupted, StopRequest

BATCH_KEY = "train.micro_batch_size"


def parse_sweep(items: list[str]) -> list[tuple[str, list[Any]]]:
    """``["train.micro_batch_size=1,2,4"]`` -> ``[("train.micro_batch_size", [1, 2, 4])]``."""
    sweeps = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--sweep {shown(item)}: expected KEY=V1,V2,..., for example --sweep train.micro_batch_size=2,4,8")
        key, values = item.split("=", 1)
        sweeps.append((key.strip(), [parse_override(f"{key}={v}")[1] for v in values.split(",")]))
    return sweeps


def variants(base: RunConfig, sweeps: list[tuple[str, list[Any]]]) -> list[tuple[str, list[str]]]:
    """(label, overrides) per combination. Sweeping the micro-batch without the accumulation
    keeps the global batch constant: grad_accum = global batch / micro-batch."""
    keys = [k for k, _ in sweeps]
    t = base.train
    hold_global = BATCH_KEY in keys and "train.grad_accum" not in keys
    # train.global_batch_size holds it itself (grad_accum follows the micro-batch); else micro-batch x accumulation
    global_batch = t.global_batch_size or (t.micro_batch_size * t.grad_accum if isinstance(t.micro_batch_size, int) else None)
    if hold_global and global_batch is None:
        raise ConfigError(f"--sweep {BATCH_KEY}: the config's micro_batch_size is auto, so there is no global batch to "
                          "hold: set train.global_batch_size (or a number for train.micro_batch_size)")
    out = []
    for combo in itertools.product(*[vals for _, vals in sweeps]) if sweeps else [()]:
        overrides = [f"{k}={json.dumps(v)}" for k, v in zip(keys, combo)]
        label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, combo)) or "config"
        if hold_global:
            mbs = combo[keys.index(BATCH_KEY)]
            if not isinstance(mbs, int):  # auto (validated before): train.global_batch_size holds the batch, or nothing
                if t.global_batch_size is None:
                    raise ConfigError(f"--sweep {BATCH_KEY}={mbs}: an auto micro-batch holds the global batch only "
                                      "under train.global_batch_size; set it (--set train.global_batch_size=N)")
                label += " (accum follows)"
            elif global_batch % mbs:
                raise ConfigError(f"--sweep {BATCH_KEY}={mbs}: does not divide the global batch {global_batch}")
            else:
                if t.global_batch_size is None:
                    overrides.append(f"train.grad_accum={global_batch // mbs}")
                label += f" (x{global_batch // mbs} accum)"
        out.append((label, overrides))
    return out


def _checked(what: str, config_path: str | None, overrides: list[str]) -> None:
    """The config with ``overrides`` validates; else its error, led by ``what`` (the sweep value or variant)."""
    try:
        load_config(config_path, overrides)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


def synthetic_corpus(path: Path, documents: int = 400, seed: int = 0) -> Path:
    """Random word documents (no real data needed) for throughput-only measurements."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    with open(path, "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(rng.randint(200, 2000)))}) + "\n")
    return path


def bench_overrides(warmup: int, steps: int, workdir: Path, synthetic: bool) -> list[str]:
    fixed = [
        f"train.max_steps={warmup + steps}",
        "train.epochs=null",
        "train.eval_every=null",
        "data.eval=null",
        "checkpoint.every_steps=null",
        "checkpoint.every_minutes=null",
        "log.sample_prompt=null",
        "log.report=false",
        f"log.every_steps={warmup + steps + 1}",  # no log inside the window: it spans exactly the measured steps
    ]
    if synthetic:
        fixed += [f"data.train={synthetic_corpus(workdir / 'synthetic.jsonl')}", "data.format=text", "data.too_long=split"]
    return fixed


def as_measuring_child() -> StopRequest:
    """Set up a process that ``bench`` or ``plan --measure`` started to measure a run: the library log noise
    dropped as in the CLI (a spawned process starts without that), SIGTERM/SIGINT ignored. The parent answers
    them for the whole command and kills this process: a run here neither stops on them (the StopRequest
    returned is never entered, so it installs no handler) nor dies of a Ctrl-C meant for the parent."""
    from ..library_logs import quiet_library_logs

    quiet_library_logs()
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    exit_with_parent()
    return StopRequest()


def exit_with_parent(every_s: float = 0.5) -> None:
    """End this process when the one that started it is gone (killed at once: SIGKILL, or a signal its handler
    did not take), rather than measure on alone with signals ignored. A daemon thread compares the parent's pid."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def run_variant(config_path: str | None, overrides: list[str], warmup: int, out_dir: str, queue) -> None:
    """In a child process: set up the run, train ``warmup`` steps, then the measured steps."""
    try:
        stop = as_measuring_child()
        from rich.console import Console

        from ..engine.trainer import open_run, train_loop
        from ..metrics.console import ConsoleReporter
        from ..metrics.tracker import read_metrics

        cfg = load_config(config_path, overrides)
        with open_run(cfg, Path(out_dir), ConsoleReporter(Console(quiet=True)), resume="never", stop=stop) as run:
            train_loop(run, warmup)  # warm-up: compile, allocator, caches; logged at its last step and discarded
            train_loop(run)  # the measured steps: one log record spans exactly them
        rec = [r for r in read_metrics(run.out / "metrics.jsonl") if "loss" in r][-1]
        queue.put({k: rec.get(k) for k in ("tokens_per_s", "samples_per_s", "mfu", "data_wait_pct", "peak_memory_bytes", "loss")})
    except BaseException as e:  # the parent reports it beside the other variants
        queue.put({"error": f"{type(e).__name__}: {e}"})


def bench(config_path: str | None, overrides: list[str], sweeps: list[str], steps: int, warmup: int, synthetic: bool) -> list[dict]:
    """Run every variant in its own process; returns one result dict per variant. SIGTERM/SIGINT stops the
    variant running and the ones after it (``Interrupted``); the runs' directories are removed either way."""
    base = load_config(config_path, overrides)
    swept = parse_sweep(sweeps)
    for key, values in swept:  # each value alone first, as train --set takes it: the error names the value given
        for v in values:
            _checked(f"--sweep {key}={v if isinstance(v, str) else json.dumps(v)}", config_path,
                     [*overrides, f"{key}={json.dumps(v)}"])
    chosen = variants(base, swept)
    for label, extra in chosen:  # then every variant, before any runs
        _checked(f"--sweep variant {label}", config_path, [*overrides, *extra])
    workdir = Path(tempfile.mkdtemp(prefix="trainforge-bench-"))
    results = []
    ctx = multiprocessing.get_context("spawn")  # a fresh process per variant: its own peak memory, no state carried over
    try:
        fixed = bench_overrides(warmup, steps, workdir, synthetic)
        with StopRequest("stopping the benchmark (its variant's steps are cut short: nothing measured)", quick=True) as stop:
            for i, (label, extra) in enumerate(chosen):
                result = None
                if not stop.requested:  # (one that came with the last variant's result: the next does not start)
                    queue = ctx.Queue()
                    proc = ctx.Process(target=run_variant, args=(config_path, [*overrides, *extra, *fixed], warmup, str(workdir / f"v{i}"), queue))
                    proc.start()
                    result = wait_for_variant(proc, queue, stop)
                if result is None:
                    raise Interrupted(f"bench stopped by {stop.name} after {len(results)} of {len(chosen)} variants "
                                      "(a variant cut short measures nothing): run it again", stop.name)
                results.append({"variant": label, "overrides": extra, **result})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # each variant's run directory: a large model's final/ weights included
    return results


def wait_for_variant(proc, queue, stop: StopRequest) -> dict | None:
    """The result ``proc`` puts on ``queue``; None once ``stop`` is requested (the variant is killed: its steps
    are cut short, so it measures nothing); an error result when the process ends without one (killed)."""
    while True:
        try:
            result = queue.get(timeout=0.2)
            proc.join()
            return result
        except queue_module.Empty:
            if stop.requested:
                proc.kill()
                proc.join()
                return None
            if not proc.is_alive():  # its result may have reached the pipe as it ended: one last look
                try:
                    return queue.get(timeout=1.0)
                except queue_module.Empty:
                    return {"error": f"the variant's process ended without a result (exit code {proc.exitcode})"}


def render(results: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title="trainforge bench")
    for col in ("variant", "tokens/s", "MFU", "peak memory", "data wait", "loss"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["variant"], "[red]failed[/red]", r["error"][:60], "", "", "")
            continue
        table.add_row(
            r["variant"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
            f"{r['peak_memory_bytes'] / 2**30:.2f} GiB",
            f"{r['data_wait_pct']:.2f}%",
            f"{r['loss']:.4f}",
        )
    console.print(table)
