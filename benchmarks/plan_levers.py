"""The memory levers as `trainforge plan` predicts them, beside what `benchmarks/bench_memory.py`
measured for the same runs: same model, data, micro-batch, row length and LoRA settings, read from
bench_memory's JSON.

    python benchmarks/bench_memory.py --runs tf-full-fp32,tf-full-fp32-ckpt,tf-lora-fp32,tf-lora-bf16,tf-lora-bf16-ckpt,tf-qlora-bf16-ckpt --out bm.json
    python benchmarks/plan_levers.py --measured bm.json [--json levers.json]

Each quantity is compared with the same quantity:
- tensors: plan's peak of live tensors in one step against the live tensor peak of a real
  steady-state step (bench_memory's last step, traced as `plan --measure` traces);
- steps: plan's process peak of a step against the peak RSS of the training steps (the traced one included);
- load: plan's peak RSS while the model loads against the peak RSS before the first step;
- run: plan's larger of the two against the peak RSS of the whole run.
A lever's saving is the difference between the runs without and with it, so fixed costs cancel. The
tensor savings are the ones `plan` prints for a run (`memory.levers` in `--json`): a lever there is
the same config traced with that one setting flipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import GIB, TF_RUNS, build_inputs  # noqa: E402  (the benchmark's own runs and model)

LEVERS = [  # (lever, run without it, run with it)
    ("activation checkpointing (full, fp32)", "tf-full-fp32", "tf-full-fp32-ckpt"),
    ("bf16 frozen base (LoRA)", "tf-lora-fp32", "tf-lora-bf16"),
    ("activation checkpointing (LoRA, bf16)", "tf-lora-bf16", "tf-lora-bf16-ckpt"),
    ("NF4 base (QLoRA vs LoRA, bf16, checkpointing)", "tf-lora-bf16-ckpt", "tf-qlora-bf16-ckpt"),
    ("all three (full fp32 -> QLoRA)", "tf-full-fp32", "tf-qlora-bf16-ckpt"),
]
QUANTITIES = ("tensors", "steps", "load", "run")
NAN = float("nan")


def model_dir(settings: dict) -> Path:
    """The measured run's model directory, or the same model rebuilt (same seed, data and tokenizer)."""
    path = Path(settings["paths"]["model_dir"])
    if (path / "config.json").is_file():
        return path
    rebuilt = build_inputs(Path(tempfile.mkdtemp(prefix="trainforge-levers-")), dict(settings))
    return Path(rebuilt["paths"]["model_dir"])


def predict(settings: dict, model: Path, name: str, work: Path) -> dict:
    """`trainforge plan --json` for one of bench_memory's runs -> {tensors, steps, load, run} in GiB."""
    overrides = TF_RUNS[name]
    data = work / "one.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = {
        "model": {"path": str(model), "method": overrides["model.method"],
                  "lora": {"r": settings["lora"]["r"], "alpha": settings["lora"]["alpha"]}},
        "data": {"train": str(data), "eval": None, "max_length": settings["max_length"]},
        "train": {"max_steps": settings["steps"], "micro_batch_size": settings["batch_size"], "device": "cpu",
                  "precision": overrides["train.precision"],
                  "activation_checkpointing": overrides.get("train.activation_checkpointing", False)},
    }  # fmt: skip
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(settings.get("threads", 1))}
    r = subprocess.run([sys.executable, "-m", "trainforge", "plan", str(path), "--json"], capture_output=True, text=True, env=env)
    if r.returncode not in (0, 1):
        raise SystemExit(f"plan failed for {name}:\n{r.stderr[-2000:]}")
    m = json.loads(r.stdout)["memory"]
    load = m.get("load_process_bytes") or 0
    return {"tensors": m["peak_tensor_bytes"] / GIB, "steps": m["peak_process_bytes"] / GIB, "load": load / GIB,
            "run": max(m["peak_process_bytes"], load) / GIB, "levers": {k: v / GIB for k, v in m["levers"].items()}}


def read_measured(results: dict) -> dict[str, dict[str, float]]:
    """bench_memory's results -> {run: {tensors, steps, load, run}} in GiB."""
    out = {}
    for name, r in results.items():
        if "peak_rss_bytes" not in r:
            continue
        phases = r.get("phase_peak_rss_bytes", {})
        out[name] = {
            "tensors": r.get("live_tensor_peak_bytes", NAN) / GIB,
            # the training steps, the traced last one included (with --steps 2 it is the only one with Adam state)
            "steps": max(phases.get("steps", NAN), phases.get("traced_step", NAN)) / GIB,
            "load": phases.get("load", NAN) / GIB,
            "run": r["peak_rss_bytes"] / GIB,
        }
    return out


def ratio(p: float, q: float) -> str:
    return f"{p / q:.2f}" if q == q and abs(q) > 0.005 else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, required=True, help="bench_memory.py --out JSON")
    ap.add_argument("--json", type=Path, help="write predicted and measured figures here")
    args = ap.parse_args()
    bench = json.loads(args.measured.read_text())
    settings, measured = bench["settings"], read_measured(bench["results"])
    runs = [name for name in TF_RUNS if name in measured]
    model, work = model_dir(settings), Path(tempfile.mkdtemp(prefix="trainforge-levers-"))
    predicted = {name: predict(settings, model, name, work) for name in runs}
    print(f"{settings['parameters'] / 1e6:.0f}M-parameter Llama, micro-batch {settings['batch_size']} x {settings['max_length']} "
          f"tokens, LoRA r {settings['lora']['r']}; plan / measured, GiB\n")  # fmt: skip
    print("| run | tensors of a step | ratio | process, steps | ratio | load | ratio | whole run | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in runs:
        p, q = predicted[name], measured[name]
        print(f"| {name} | " + " | ".join(f"{p[k]:.2f} / {q[k]:.2f} | {ratio(p[k], q[k])}" for k in QUANTITIES) + " |")
    print("\nsavings, plan / measured, GiB\n")
    print("| lever | tensors of a step | ratio | process, steps | ratio | whole run | ratio |")
    print("|---|---|---|---|---|---|---|")
    savings = {}
    for lever, before, after in LEVERS:
        if before not in predicted or after not in predicted:
            continue
        cells, savings[lever] = [], {}
        for k in ("tensors", "steps", "run"):
            p = predicted[before][k] - predicted[after][k]
            q = measured[before][k] - measured[after][k]
            savings[lever][k] = {"plan": p, "measured": q}
            cells.append(f"{p:.2f} / {q:.2f} | {ratio(p, q)}")
        print(f"| {lever} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "predicted": predicted, "measured": measured, "savings": savings}, indent=1))


if __name__ == "__main__":
    main()
