"""How close `trainforge plan` comes to the real thing, on this machine, config by config.

For each config: `trainforge plan --measure --json` (the prediction, then real steps at the planned
settings, longest rows first, in a fresh process: the step's tensor peak as the allocator counts it, not
plan's own tracer: `torch.cuda.max_memory_allocated` on a GPU; on a CPU the storages alive at the step's
start plus the peak of c10's CPU allocator events during it, from torch.profiler; and process peak RSS), and
`trainforge bench` on the same config (steady-state tokens/s). Two model sizes x full / LoRA / QLoRA
x activation checkpointing on/off, plus one 2-process DDP run (`trainforge train --nproc 2`: peak RSS
of the largest process and tokens/s from its metrics).

    python benchmarks/bench_plan.py [--out results.json] [--only NAME ...] [--device cuda]

`--device cuda` runs the same grid on the GPU at GPU sizes (~100M and ~400M parameters, rows of
1024 tokens, precision auto: bf16 where supported), against the `this` profile; no DDP row.

Prints a Markdown table: predicted / measured for peak tensors, peak process memory and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

GIB = 2**30
SIZES = {
    # name: (hidden, intermediate, layers, heads, vocab, micro-batch, max_length)
    "6M": (256, 688, 4, 4, 2048, 8, 256),
    "30M": (512, 1376, 6, 8, 8192, 4, 256),
}
GPU_SIZES = {
    "100M": (768, 2048, 12, 12, 8192, 16, 1024),
    "400M": (1024, 2816, 24, 16, 8192, 8, 1024),
}


def make_data(workdir: Path) -> Path:
    """Long pseudo-text documents: split into full rows of one document each (the plan's worst case)."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(4000)]
    path = workdir / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(1500))}) + "\n")
    return path


def make_model_dir(workdir: Path, size: str, data: Path) -> Path:
    """A 'pretrained' Llama directory of this size (random weights) with a BPE tokenizer of the data."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.model.tokenizer import train_bpe_tokenizer

    hidden, inter, layers, heads, vocab, _, _ = {**SIZES, **GPU_SIZES}[size]
    path = workdir / f"llama-{size}"
    if (path / "config.json").is_file():
        return path
    texts = (json.loads(line)["text"] for line in open(data))
    tok = train_bpe_tokenizer(texts, vocab_size=vocab)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def config_for(workdir: Path, name: str, size: str, method: str, ckpt: bool, data: Path, device: str = "cpu") -> Path:
    *_, mbs, length = {**SIZES, **GPU_SIZES}[size]
    model: dict = {"path": str(make_model_dir(workdir, size, data)), "method": method}
    if method != "full":
        model["lora"] = {"r": 16, "alpha": 32}
    cfg = {
        "model": model,
        "data": {"train": str(data), "eval": None, "max_length": length, "cache_dir": str(workdir / "cache")},
        # CPU: fp32 (bf16 autocast is emulated on CPUs without native bf16); GPU: what a user gets
        "train": {"max_steps": 12, "micro_batch_size": mbs, "precision": "fp32" if device == "cpu" else "auto",
                  "compile": False, "activation_checkpointing": ckpt, "device": device},
        "log": {"every_steps": 4, "report_to": []},
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "trainforge", *args], cwd=cwd, env=env, capture_output=True, text=True)


def run_one(workdir: Path, name: str, cfg: Path, ddp: bool = False) -> dict:
    plan_args = ["plan", str(cfg), "--json"] + (["--nproc", "2"] if ddp else ["--measure", "--measure-steps", "6"])
    r = cli(*plan_args, cwd=workdir)
    if r.returncode not in (0, 1):
        return {"name": name, "error": r.stderr[-2000:]}
    plan = json.loads(r.stdout)
    row = {
        "name": name,
        "predicted_tensors": plan["memory"]["peak_tensor_bytes"],
        "predicted_process": plan["memory"]["peak_process_bytes"],
        "predicted_tokens_per_s": plan["time"]["tokens_per_s"],
        "levers": plan["memory"]["levers"],
    }
    if ddp:
        out = workdir / f"run-{name.replace(' ', '-')}"
        shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (--resume never refuses an old one)
        r = cli("train", str(cfg), "--nproc", "2", "--output", str(out), "--resume", "never", cwd=workdir)
        if r.returncode != 0:
            return {**row, "error": r.stderr[-2000:]}
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        row["measured_process"] = summary["peak_memory_bytes"]
        row["measured_tokens_per_s"] = [x for x in records if "loss" in x][-1]["tokens_per_s"]
        return row
    measured = plan.get("measured", {})
    if "error" in measured:
        return {**row, "error": measured["error"]}
    row["measured_tensors"] = measured["allocated_step_peak_bytes"]  # the allocator's count
    row["traced_tensors"] = measured["live_tensor_peak_bytes"]  # plan's tracer on the real step, for reference
    row["measured_process"] = measured["process_peak_bytes"]
    bench_out = workdir / f"bench-{name}.json"
    r = cli("bench", str(cfg), "--steps", "6", "--warmup", "2", "--out", str(bench_out), cwd=workdir)
    if r.returncode != 0:
        return {**row, "error": r.stderr[-2000:]}
    row["measured_tokens_per_s"] = json.loads(bench_out.read_text())[0]["tokens_per_s"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| config | tensors: predicted / allocator GiB | ratio | process peak: predicted / measured GiB | ratio | tokens/s: predicted / bench | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'].splitlines()[-1][:80] if r['error'] else ''} | | | | | |")
            continue
        t = (f"{r['predicted_tensors'] / GIB:.3f} / {r['measured_tensors'] / GIB:.3f}", f"{r['predicted_tensors'] / r['measured_tensors']:.2f}") \
            if "measured_tensors" in r else (f"{r['predicted_tensors'] / GIB:.3f} / -", "-")
        p = (f"{r['predicted_process'] / GIB:.2f} / {r['measured_process'] / GIB:.2f}", f"{r['predicted_process'] / r['measured_process']:.2f}")
        s = (f"{r['predicted_tokens_per_s']:,.0f} / {r['measured_tokens_per_s']:,.0f}", f"{r['predicted_tokens_per_s'] / r['measured_tokens_per_s']:.2f}")
        lines.append(f"| {r['name']} | {t[0]} | {t[1]} | {p[0]} | {p[1]} | {s[0]} | {s[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write every row as JSON here")
    ap.add_argument("--only", nargs="*", help="config names to run (default: all)")
    ap.add_argument("--workdir", type=Path, help="keep models, caches and runs here (default: a temporary directory)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the GPU grid (GPU sizes, no DDP row)")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainforge-bench-plan-"))
    workdir.mkdir(parents=True, exist_ok=True)
    data = make_data(workdir)
    plans = [(f"{size} {method}{' +ckpt' if ckpt else ''}", size, method, ckpt)
             for size in (SIZES if args.device == "cpu" else GPU_SIZES)
             for method in ("full", "lora", "qlora") for ckpt in (False, True)]
    rows = []
    for name, size, method, ckpt in plans:
        if args.only and name not in args.only:
            continue
        cfg = config_for(workdir, name.replace(" ", "-"), size, method, ckpt, data, args.device)
        rows.append(run_one(workdir, name, cfg))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.device == "cpu" and (not args.only or "6M full DDP x2" in args.only):
        cfg = config_for(workdir, "6M-full-ddp", "6M", "full", False, data)
        rows.append(run_one(workdir, "6M full DDP x2", cfg, ddp=True))
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
