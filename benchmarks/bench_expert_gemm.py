"""The experts' GEMM on this CPU: fp32 against bf16, three ways of computing it, and how many cores each keeps busy.

    python benchmarks/bench_expert_gemm.py [--tokens 2048] [--experts 16] [--hidden 256] [--out 512] [--threads 2]

One MoE projection of routed rows sorted by expert (an equal share each): ``torch.nn.functional.grouped_mm`` (what
transformers' ``grouped_mm`` experts and trainforge's call on a CPU), a loop of ``torch.mm`` (transformers' fallback)
and one ``bmm``. Reported per dtype and way: the best of 5 wall times, CPU-seconds per wall second (cores busy) and
the largest difference from the loop's result.

Why it exists: on a CPU without native bf16 (AVX2 only) a bf16 GEMM is emulated, single-threaded and tens of times
slower than fp32, whichever of the three computes it. transformers' grouped GEMM is not autocast-aware (it computes
in the weights' dtype): an fp32 base's experts stay fp32 under bf16 autocast, a base stored in bf16 (trainforge's
LoRA base in the run's precision) takes the emulated path. That decides `compare_moe.py`'s LoRA row on such a CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def measure(fn, repeat: int = 5) -> tuple[float, float]:
    """(best wall seconds, CPU-seconds per wall second of that call) of ``fn()``, after one warm-up call."""
    fn()
    best, busy = float("inf"), 0.0
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        if wall < best:
            best, busy = wall, cpu / wall
    return best, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="routed rows (tokens x top-k)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", type=int, default=512, help="the projection's output width (gate_up: 2 x intermediate)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, e = args.tokens - args.tokens % args.experts, args.experts
    offsets = torch.cumsum(torch.full((e,), n // e), 0, dtype=torch.int32)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(n, args.hidden, dtype=dtype), torch.randn(e, args.hidden, args.out, dtype=dtype)

        def loop(x=x, w=w) -> torch.Tensor:
            out, start = x.new_empty(n, args.out), 0
            for i, end in enumerate(offsets.tolist()):
                torch.mm(x[start:end], w[i], out=out[start:end])
                start = end
            return out

        ways = {"grouped_mm": lambda x=x, w=w: F.grouped_mm(x, w, offs=offsets), "mm loop": loop,
                "bmm": lambda x=x, w=w: torch.bmm(x.view(e, n // e, -1), w).view(n, -1)}
        reference = loop().float()
        for name, fn in ways.items():
            wall, busy = measure(fn)
            err = float((fn().float() - reference).abs().max())
            rows.append({"dtype": str(dtype).removeprefix("torch."), "way": name, "ms": round(wall * 1e3, 2),
                         "cores_busy": round(busy, 2), "max_abs_diff": err})
            print(f"{rows[-1]['dtype']:9s} {name:10s} {wall * 1e3:8.2f} ms  cores busy {busy:.2f}  max diff {err:.1e}")
    fp32 = min(r["ms"] for r in rows if r["dtype"] == "float32")
    bf16 = min(r["ms"] for r in rows if r["dtype"] == "bfloat16")
    print(json.dumps({"shape": vars(args), "rows": rows, "bf16_over_fp32": round(bf16 / fp32, 1)}))


if __name__ == "__main__":
    main()
