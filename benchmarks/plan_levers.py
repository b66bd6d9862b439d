"""The memory levers as `trainforge plan` predicts them, beside what `benchmarks/bench_memory.py`
measured for the same runs (the README's memory-levers table: peak RSS of each run's process,
170M-parameter Llama, 4 x 256 tokens, LoRA r 16 on every linear layer).

    python benchmarks/plan_levers.py [--measured results.json]

Without --measured, the figures of the README table are used (bench_memory.py, 2 CPU cores,
2026-11-22). A lever's saving is the difference between two runs, so the process's fixed cost
cancels: predicted and measured savings compare directly.
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

GIB = 2**30
README_PEAK_RSS_GIB = {  # bench_memory.py, as in the README's memory-levers table
    "tf-full-fp32": 4.28, "tf-full-fp32-ckpt": 3.44, "tf-lora-fp32": 3.36,
    "tf-lora-bf16": 2.03, "tf-lora-bf16-ckpt": 1.31, "tf-qlora-bf16-ckpt": 1.31,
}
RUNS = {  # name -> (method, precision, checkpointing), as bench_memory.TF_RUNS
    "tf-full-fp32": ("full", "fp32", False), "tf-full-fp32-ckpt": ("full", "fp32", True),
    "tf-lora-fp32": ("lora", "fp32", False), "tf-lora-bf16": ("lora", "bf16", False),
    "tf-lora-bf16-ckpt": ("lora", "bf16", True), "tf-qlora-bf16-ckpt": ("qlora", "bf16", True),
}
LEVERS = [  # (lever, run without it, run with it)
    ("activation checkpointing (full, fp32)", "tf-full-fp32", "tf-full-fp32-ckpt"),
    ("bf16 frozen base (LoRA)", "tf-lora-fp32", "tf-lora-bf16"),
    ("activation checkpointing (LoRA, bf16)", "tf-lora-bf16", "tf-lora-bf16-ckpt"),
    ("NF4 base (QLoRA vs LoRA, bf16, checkpointing)", "tf-lora-bf16-ckpt", "tf-qlora-bf16-ckpt"),
    ("all three (full fp32 -> QLoRA)", "tf-full-fp32", "tf-qlora-bf16-ckpt"),
]


def model_dir(root: Path) -> Path:
    """bench_memory's 170M Llama, saved with (random) fp32 weights as bench_memory saves it: loading
    maps the weight file, which is part of what a CPU run's peak RSS holds."""
    path = root / "llama-170m"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=8192, max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def predict(root: Path, name: str) -> dict:
    method, precision, ckpt = RUNS[name]
    data = root / "one.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = {
        "model": {"path": str(model_dir(root)), "method": method, "lora": {"r": 16, "alpha": 32}},
        "data": {"train": str(data), "eval": None, "max_length": 256},
        "train": {"max_steps": 3, "micro_batch_size": 4, "precision": precision, "activation_checkpointing": ckpt, "device": "cpu"},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "trainforge", "plan", str(path), "--json"], capture_output=True, text=True, env=env)
    if r.returncode not in (0, 1):
        raise SystemExit(f"plan failed for {name}:\n{r.stderr[-2000:]}")
    m = json.loads(r.stdout)["memory"]
    return {"tensors": m["peak_tensor_bytes"] / GIB, "process": m["peak_process_bytes"] / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, help="bench_memory.py --out JSON (default: the README's figures)")
    args = ap.parse_args()
    measured = dict(README_PEAK_RSS_GIB)
    if args.measured:
        measured = {r["name"]: r["peak_rss_bytes"] / GIB for r in json.loads(args.measured.read_text()) if "peak_rss_bytes" in r}
    root = Path(tempfile.mkdtemp(prefix="trainforge-levers-"))
    predicted = {name: predict(root, name) for name in RUNS}
    print("| run | plan: tensors GiB | plan: process GiB | measured peak RSS GiB |")
    print("|---|---|---|---|")
    for name in RUNS:
        p = predicted[name]
        print(f"| {name} | {p['tensors']:.2f} | {p['process']:.2f} | {measured.get(name, float('nan')):.2f} |")
    print()
    print("| lever | plan: saving GiB | measured saving GiB | plan / measured |")
    print("|---|---|---|---|")
    for lever, before, after in LEVERS:
        p = predicted[before]["process"] - predicted[after]["process"]
        q = measured[before] - measured[after]
        print(f"| {lever} | {p:.2f} | {q:.2f} | {p / q:.2f} |" if q else f"| {lever} | {p:.2f} | {q:.2f} | - |")


if __name__ == "__main__":
    main()
