"""Every optimizer that runs on this machine, side by side on the built-in default: state memory
against plan's prediction, loss after N steps against AdamW's, tokens/s.

    python benchmarks/bench_optimizers.py                 # 200 steps each
    python benchmarks/bench_optimizers.py --steps 50 --names adamw,adamw_8bit

Each variant is one ``trainforge train`` run in its own process (the real CLI), from the same seed
and data; its ``summary.json`` holds the state bytes the optimizer held at the end
(``optimizer.state_bytes``), and ``trainforge plan --json`` on the same settings its prediction.
The loss is the mean training loss of the last 20 logged steps (every step is logged).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

NAMES = ["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw", "adamw_4bit"]


def trainforge(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainforge", *args], cwd=cwd, capture_output=True, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--names", default=",".join(NAMES))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.names.split(","):
            sets = ["--set", f"optim.name={name}", "--set", f"train.max_steps={args.steps}", "--set", "log.every_steps=1",
                    "--set", "train.compile=false"]
            plan = trainforge("plan", "--json", *sets, cwd=work)
            predicted = json.loads(plan.stdout)["optimizer"]["device_bytes"] if plan.returncode in (0, 5) else None
            done = trainforge("train", "--output", str(work / name), *sets, cwd=work)
            if done.returncode != 0:
                rows.append({"name": name, "error": done.stderr.strip().splitlines()[-1]})
                continue
            summary = json.loads((work / name / "summary.json").read_text())
            losses = [json.loads(line)["loss"] for line in (work / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
            rows.append({"name": name, "state": summary["optimizer"]["state_bytes"], "predicted": predicted,
                         "loss": sum(losses[-20:]) / len(losses[-20:]), "eval": summary.get("eval_loss"),
                         "tokens_per_s": summary["tokens_per_s"]})
            print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["name"] == "adamw" and "loss" in r), None)
    print(f"\n| optim.name | state (measured) | plan's prediction | error | loss, last 20 of {args.steps} steps | vs adamw | eval loss | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} | | | | | | |")
            continue
        err = f"{r['predicted'] / r['state'] - 1:+.1%}" if r["predicted"] else ""
        vs = f"{r['loss'] / base['loss'] - 1:+.2%}" if base else ""
        print(f"| {r['name']} | {r['state'] / 2**20:.2f} MiB | {(r['predicted'] or 0) / 2**20:.2f} MiB | {err} | {r['loss']:.4f} | {vs} | "
              f"{r['eval']:.4f} | {r['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
