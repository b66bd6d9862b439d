"""Peak memory of one LoRA training step at long row lengths, with and without the long-context levers.

Each (length, levers) runs in its own process, which builds a 4-layer Llama-shaped model (random weights,
bf16 frozen base, LoRA r=16 on every linear layer, fp32 adapters), runs training steps (two by default) on one row
of ``length`` tokens (trainforge's chunked fused loss, autocast bf16) and reports its peak RSS
(``ru_maxrss``) and the step's seconds. Levers: none; ckpt (activation checkpointing); tiled (checkpointing
+ tiled MLP). Activation offload acts on a GPU only (on a CPU it changes nothing) and is not measured here.

    PYTHONPATH=src python benchmarks/bench_long_context.py --lengths 8192 16384 --levers none ckpt tiled

Figures recorded in docs/long-context.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SHAPE = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1 << 17)
LEVERS = {"none": (False, False), "ckpt": (True, False), "tiled": (True, True)}


def one(length: int, levers: str, steps: int = 2, precision: str = "bf16") -> dict:
    """One configuration in this process: peak RSS (GiB) and seconds of the last of ``steps`` steps."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.config.run import LoraSettings
    from trainforge.data.loader import Batch
    from trainforge.engine.step import loss_sum
    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.load import apply_lora, enable_activation_checkpointing
    from trainforge.model.packed_attention import register_causal
    from trainforge.model.tiled_mlp import apply_tiled_mlp

    ckpt, tiled = LEVERS[levers]
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE)
    # causal SDPA without a materialized mask (what training's packed-attention path uses)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_causal())
    model = model.to(torch.bfloat16) if precision == "bf16" else model
    if ckpt:
        enable_activation_checkpointing(model)
    model = apply_lora(model, LoraSettings(r=16, alpha=32, target_modules="all-linear"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if tiled:
        apply_tiled_mlp(model)
    model.train()
    ids = torch.randint(0, SHAPE["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    batch = Batch(ids, ids, None, length, length, [0])
    seconds = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        loss = loss_sum(model, batch, PRECISIONS[precision], True)
        (loss / length).backward()
        model.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"length": length, "levers": levers, "precision": precision, "peak_rss_gib": round(peak / 2**30, 3), "step_s": round(seconds, 1),
            "tokens_per_s": round(length / seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--steps", type=int, default=2, help="steps per configuration (the last is timed; 1: peak only)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="fp32 where the CPU has no native bf16 (emulated bf16 is several times slower)")
    ap.add_argument("--one", nargs=2, metavar=("LENGTH", "LEVERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.steps, args.precision)))
        return
    for length in args.lengths:
        for levers in args.levers:
            out = subprocess.run([sys.executable, __file__, "--one", str(length), levers, "--steps", str(args.steps), "--precision", args.precision], capture_output=True, text=True)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else \
                json.dumps({"length": length, "levers": levers, "error": out.stderr.strip().splitlines()[-1:]})
            print(line, flush=True)


if __name__ == "__main__":
    main()
