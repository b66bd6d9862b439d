"""Model FLOPs per trained token and the device's peak, for MFU.

FLOPs per token (PaLM appendix B convention, matmuls only):
- a weight matrix of n parameters costs 2n forward, 2n for the input gradient, and 2n
  for its weight gradient only when it is trained (LoRA: frozen weights skip that);
- attention scores and values cost 2 x 2 x layers x width x context forward, x3 with backward,
  counted over the full row length.
MFU = achieved model FLOP/s / peak FLOP/s of the device in the precision used.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# dense peak TFLOP/s by GPU name fragment: (bf16/fp16 tensor core, tf32, fp32)
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0, 67.0),
    "H100 SXM": (989.0, 494.0, 67.0),
    "H100 PCIe": (756.0, 378.0, 51.0),
    "H100": (989.0, 494.0, 67.0),
    "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6),
    "L4": (121.0, 60.0, 30.3),
    "A10": (125.0, 62.5, 31.2),
    "RTX 4090": (165.2, 82.6, 82.6),
    "RTX 3090": (71.0, 35.6, 35.6),
    "V100": (125.0, 15.7, 15.7),
    "T4": (65.0, 8.1, 8.1),
}


def linear_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trained, frozen) parameter counts of the matrices that multiply activations (not embeddings)."""
    trained = frozen = 0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.ndim != 2 or id(p) in embeddings and not isinstance(module, torch.nn.Linear):
                continue
            if p.requires_grad:
                trained += p.numel()
            else:
                frozen += p.numel()
    return trained, frozen


def flops_per_token(model: torch.nn.Module, context: int) -> float:
    """Training FLOPs per token: forward + backward, LoRA-aware."""
    trained, frozen = linear_params(model)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    width = getattr(config, "hidden_size", 0) or 0
    attention = 2 * 2 * layers * width * context * 3
    return 6.0 * trained + 4.0 * frozen + attention


def peak_flops(device: torch.device, precision: str, cache_dir: Path | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for this device in this precision."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (half, tf32, fp32) in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                tflops = half if precision in ("bf16", "fp16") else (tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32)
                return tflops * 1e12, f"table ({fragment})"
        return 0.0, f"unknown GPU {name!r}: no peak in the table, MFU not reported"
    return cpu_matmul_peak(precision, cache_dir), "matmul probe"


def cpu_matmul_peak(precision: str, cache_dir: Path | None = None) -> float:
    """Measured FLOP/s of a large matmul on this CPU with the current thread count; cached per machine."""
    threads = torch.get_num_threads()
    key = f"{platform.node()}-{platform.processor() or platform.machine()}-{threads}t-{precision}-torch{torch.__version__}"
    cache = (cache_dir or Path(os.environ.get("TRAINFORGE_CACHE") or Path.home() / ".cache" / "trainforge")) / "cpu_peak.json"
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except ValueError:
            table = {}
    if key in table:
        return float(table[key])
    value = measure_matmul(torch.bfloat16 if precision == "bf16" else torch.float32)
    table[key] = value
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(table, indent=1))
    except OSError:
        pass  # a read-only home only costs re-measuring next time
    return value


def measure_matmul(dtype: torch.dtype, n: int = 1024) -> float:
    """Best-of-5 FLOP/s of an n x n matmul. Uses its own generator: the run's random stream
    (dropout, data order) must not depend on whether this probe ran."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, dtype=dtype, generator=gen), torch.randn(n, n, dtype=dtype, generator=gen)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best
