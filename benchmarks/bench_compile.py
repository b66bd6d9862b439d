"""Whole-stack vs regional (per-layer) torch.compile: compile seconds and steady step time by depth.

Each (mode, depth) runs in its own process with an empty inductor cache, so every compile is cold.
The model is a Llama of the built-in default's width (4 heads x 64, MLP 688), random init, bf16
autocast off (fp32), a micro-batch of 8 x 512 tokens, forward + backward through trainforge's
compile path (``model/compile.py``)::

    python benchmarks/bench_compile.py                   # depths 2, 4, 8; both modes
    python benchmarks/bench_compile.py --depths 2 8 --steps 5 --device cuda
    python benchmarks/bench_compile.py --lora            # LoRA r16 on every linear layer (frozen base)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from trainforge.model.compile import compile_decoder
mode, depth, steps, device, lora = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=depth,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
if lora:
    from trainforge.config.model import LoraSettings
    from trainforge.model.load import apply_lora
    model = apply_lora(model, LoraSettings(r=16, alpha=32))
if mode != "eager":
    assert compile_decoder(model, print, regional=(mode == "regional"))
ids = torch.randint(0, 8192, (8, 512), device=device)
def step():
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
t = time.perf_counter(); step(); first = time.perf_counter() - t
times = []
for _ in range(steps):
    t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
print(json.dumps({"first_s": first, "step_s": sorted(times)[len(times) // 2]}))
"""


def run(mode: str, depth: int, steps: int, device: str, lora: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:  # cold: no inductor/FX graph cache from an earlier run
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, "-c", CHILD, mode, str(depth), str(steps), device, str(int(lora))],
                              env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} depth {depth} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the first (the median is reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lora", action="store_true", help="LoRA r16 on every linear layer, the base frozen")
    args = ap.parse_args()
    print("| depth | eager step | whole: compile s | whole: step | regional: compile s | regional: step |")
    print("|---|---|---|---|---|---|")
    for depth in args.depths:
        r = {mode: run(mode, depth, args.steps, args.device, args.lora) for mode in ("eager", "whole", "regional")}
        eager = r["eager"]["step_s"]
        cells = [f"{eager * 1000:.0f} ms"]
        for mode in ("whole", "regional"):
            compile_s = r[mode]["first_s"] - r[mode]["step_s"]  # the first step's extra time is the compile
            cells += [f"{compile_s:.1f}", f"{r[mode]['step_s'] * 1000:.0f} ms ({eager / r[mode]['step_s']:.2f}x)"]
        print(f"| {depth} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"\n{time.time() - t0:.0f} s in all; device {sys.argv[sys.argv.index('--device') + 1] if '--device' in sys.argv else 'cpu'}")
