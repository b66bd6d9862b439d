"""`train.cpu_threads: auto` against one thread per core (torch's default, what HF Trainer runs on) while
other work keeps cores busy: the same short run of the built-in default (or CONFIG) twice, side by side,
beside ``--busy`` processes that spin on the CPU for the whole measurement.

    python benchmarks/bench_cpu_threads.py [CONFIG] [--busy 1] [--steps 40] [--repeat 2] [--out results.json]

Each variant runs in its own process with OMP_NUM_THREADS unset; ``all-cores`` fixes
``train.cpu_threads`` to the machine's core count, ``auto`` lets the run choose, ``one-thread`` fixes 1
(what auto could have chosen). Reported: training
tokens/s and wall time (start-up, evaluation and final save included), and each ratio auto / all-cores.
``--busy 0`` measures an idle machine, where auto must keep every core (ratio ~1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SPIN = "while True:\n    pass\n"


def run_variant(config: str | None, threads: str, steps: int, out: Path) -> dict:
    """One training run in its own process; its summary's speed figures."""
    sets = {"train.max_steps": steps, "train.cpu_threads": threads, "train.compile": "false",
            "log.sample_prompt": "null", "log.every_steps": 10, "checkpoint.every_minutes": "null"}
    argv = [sys.executable, "-m", "trainforge", "train", *([config] if config else []), "--output", str(out)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{threads}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_time_s"], "threads": s.get("cpu_threads"),
            "reason": s.get("cpu_threads_reason"), "final_train_loss": s["final_train_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a run config (default: the built-in default)")
    ap.add_argument("--busy", type=int, default=1, help="spinning processes beside the runs (default 1)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each variant, alternated; medians reported")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    runs: dict[str, list[dict]] = {"all-cores": [], "auto": [], "one-thread": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeat):
                for name, threads in (("all-cores", str(cores)), ("auto", "auto"), ("one-thread", "1")):
                    runs[name].append(run_variant(args.config, threads, args.steps, Path(tmp) / f"{name}-{i}"))
    finally:
        for p in spinners:
            p.kill()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "wall_s")} for name, rs in runs.items()}
    result = {
        "cores": cores, "busy": args.busy, "steps": args.steps, "config": args.config or "built-in default",
        "runs": runs, "median": med,
        "auto_vs_all_cores": {"tokens_per_s": med["auto"]["tokens_per_s"] / med["all-cores"]["tokens_per_s"],
                              "wall_s": med["auto"]["wall_s"] / med["all-cores"]["wall_s"]},
        "one_thread_vs_all_cores": {"tokens_per_s": med["one-thread"]["tokens_per_s"] / med["all-cores"]["tokens_per_s"]},
    }
    print(f"{cores} cores, {args.busy} busy process(es), {args.steps} steps, {result['config']}")
    print("| variant | threads | tokens/s | wall s | loss |")
    print("|---|---|---|---|---|")
    for name, rs in runs.items():
        threads = "/".join(str(r["threads"]) for r in rs)
        loss = "/".join(f"{r['final_train_loss']:.4f}" for r in rs)
        print(f"| {name} | {threads} | {med[name]['tokens_per_s']:,.0f} | {med[name]['wall_s']:.1f} | {loss} |")
    ratio = result["auto_vs_all_cores"]
    print(f"auto / all-cores: tokens/s {ratio['tokens_per_s']:.2f}x, wall time {ratio['wall_s']:.2f}x; "
          f"one thread / all-cores: tokens/s {result['one_thread_vs_all_cores']['tokens_per_s']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
