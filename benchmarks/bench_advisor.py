"""What the live advisor costs: the same short run of the built-in default (or CONFIG) with the advisor on and
off, alternating, each in its own process, the advisor judging every step (``log.every_steps=1``).

    python benchmarks/bench_advisor.py [CONFIG] [--steps 40] [--repeat 3] [--out results.json]

The advisor has no switch in the config (it only warns); ``off`` runs the same command with the advisor's two
calls in the loop made no-ops in that process: ``Advisor.record_step`` (each step's loss and gradient norm
kept as device tensors) and the trainer's ``advise`` (the log step's judgement, its warnings and events).
Everything else, the metrics record included, is the same. Reported: median training tokens/s of each, the ratio on / off, each run's final loss (equal: the
advisor does not touch the training) and wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OFF = (
    "from trainforge.engine import trainer\n"
    "from trainforge.engine.advisor import Advisor\n"
    "Advisor.record_step = lambda self, *a, **k: None\n"
    "trainer.advise = lambda *a, **k: None\n"
    "import runpy, sys\n"
    "sys.argv[0] = 'trainforge'\n"
    "runpy.run_module('trainforge', run_name='__main__')\n"
)


def run_variant(config: str | None, advisor: bool, steps: int, out: Path) -> dict:
    """One training run in its own process; its summary's figures."""
    sets = {"train.max_steps": steps, "log.every_steps": 1, "log.sample_prompt": "null", "log.report": "false",
            "checkpoint.every_minutes": "null"}
    entry = ["-m", "trainforge"] if advisor else ["-c", OFF]
    argv = [sys.executable, *entry, "train", *([config] if config else []), "--output", str(out)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"advisor {'on' if advisor else 'off'}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_time_s"], "final_train_loss": s["final_train_loss"],
            "advice": s.get("advice", [])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a run config (default: the built-in default)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each variant, alternated; medians reported")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")  # neither always goes first
            for name in order:
                runs[name].append(run_variant(args.config, name == "on", args.steps, Path(tmp) / f"{name}-{i}"))
    med = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    result = {"steps": args.steps, "repeat": args.repeat, "config": args.config or "built-in default", "runs": runs,
              "median_tokens_per_s": med, "on_vs_off": med["on"] / med["off"]}
    print(f"{args.steps} steps, log.every_steps=1, {args.repeat} runs each, {result['config']}")
    print("| advisor | tokens/s (median) | runs | final loss | wall s |")
    print("|---|---|---|---|---|")
    for name, rs in runs.items():
        each = "/".join(f"{r['tokens_per_s']:,.0f}" for r in rs)
        loss = "/".join(f"{r['final_train_loss']:.4f}" for r in rs)
        wall = "/".join(f"{r['wall_s']:.1f}" for r in rs)
        print(f"| {name} | {med[name]:,.0f} | {each} | {loss} | {wall} |")
    print(f"advisor on / off: tokens/s {result['on_vs_off']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
