"""Data-parallel scaling on one machine: 1 process vs N processes (DDP, gloo on CPU / NCCL on GPU).

    python benchmarks/bench_ddp.py [--nproc 2] [--steps 40] [--device cpu] [--out results.json]

Every run trains the same model on the same global batch (micro-batch x accumulation x
processes), so they do the same work per step. Reported: training tokens/s (summary.json's
train_time_s: after setup, without process start-up), and scaling efficiency = tokens/s of N
processes / (N x tokens/s of 1 process with 1 thread). On CPU the cores are split between
processes: 1 process x all threads, 1 process x 1 thread, N processes x (cores / N) threads.
On a GPU, `--device cuda --nproc 1` under torchrun measures DDP's overhead on one GPU
against no DDP (both runs use one GPU).
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


def config(tokenizer: Path, steps: int, micro_batch: int, device: str) -> dict:
    return {
        "model": {
            "init": {"architecture": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "max_position_embeddings": 256},
            "tokenizer": str(tokenizer),
        },
        "data": {"train": "builtin:python-stdlib", "eval": None, "max_length": 256, "too_long": "split", "max_documents": 300},
        "train": {"max_steps": steps, "micro_batch_size": micro_batch, "grad_accum": 1, "precision": "fp32", "device": device},
        "optim": {"lr": 1e-3},
        "checkpoint": {"every_minutes": None},
        "log": {"every_steps": 10},
    }


def run(tmp: Path, name: str, cfg: dict, nproc: int, threads: int, torchrun: bool) -> dict:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRAINFORGE_CACHE": str(tmp / "cache")}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if torchrun else [sys.executable]
    cmd = [*launcher, "-m", "trainforge", "train", str(path), "--output", str(tmp / name)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.loads((tmp / name / "summary.json").read_text())
    return {"processes": nproc, "threads_per_process": threads, "tokens_per_s": s["tokens_per_s"], "train_time_s": s["train_time_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=8, help="rows per step, for every run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        from trainforge.data.prepare import training_texts
        from trainforge.config.data import DataSettings
        from trainforge.model.tokenizer import train_bpe_tokenizer

        texts = training_texts(DataSettings(train="builtin:python-stdlib", max_documents=300), "text")
        train_bpe_tokenizer(texts, 2048).save_pretrained(tmp / "tok")  # one tokenizer for all runs
        cfg = lambda mb: config(tmp / "tok", a.steps, mb, a.device)
        g, n = a.global_batch, a.nproc
        results = {}
        if a.device == "cpu":
            results["1 process x all threads"] = run(tmp, "single_all", cfg(g), 1, cores, False)
            results["1 process x 1 thread"] = run(tmp, "single_1", cfg(g), 1, 1, False)
            results[f"{n} processes (DDP)"] = run(tmp, "ddp", cfg(g // n), n, max(1, cores // n), True)
            base = results["1 process x 1 thread"]["tokens_per_s"]
            results["scaling_efficiency_vs_1_thread"] = results[f"{n} processes (DDP)"]["tokens_per_s"] / (n * base)
            results["speedup_vs_all_threads"] = results[f"{n} processes (DDP)"]["tokens_per_s"] / results["1 process x all threads"]["tokens_per_s"]
        else:
            results["no DDP"] = run(tmp, "plain", cfg(g), 1, 8, False)
            results["DDP, 1 process"] = run(tmp, "ddp1", {**cfg(g), "train": {**cfg(g)["train"], "distributed": "ddp"}}, 1, 8, True)
            results["ddp_overhead"] = 1 - results["DDP, 1 process"]["tokens_per_s"] / results["no DDP"]["tokens_per_s"]
            if n > 1:
                results[f"{n} processes (DDP)"] = run(tmp, "ddpn", cfg(g // n), n, 8, True)
    print(json.dumps(results, indent=2))
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
