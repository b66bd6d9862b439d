"""What the machine can do: device, native precisions, memory."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import default_cache_dir


@dataclass(frozen=True)
class Precision:
    """How a run computes: autocast dtype (None: plain fp32) and whether fp16 loss scaling is needed."""

    name: str  # "bf16" | "fp16" | "fp32"
    autocast_dtype: torch.dtype | None
    needs_grad_scaler: bool

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Context for forward passes: mixed precision where chosen, nothing otherwise."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


PRECISIONS = {
    "fp32": Precision("fp32", None, False),
    "bf16": Precision("bf16", torch.bfloat16, False),
    "fp16": Precision("fp16", torch.float16, True),
}


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA when present (or asked), else CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={requested!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    return device


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and _cpu_flags() & {"avx512_bf16", "amx_bf16"} != set()
    except (AttributeError, RuntimeError):
        return False


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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


def peak_flops(device: torch.device, precision: str, cache_dir: Path | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for this device in this precision."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (half, tf32, fp32) in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                tflops = half if precision in ("bf16", "fp16") else (tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32)
                return tflops * 1e12, f"table ({fragment})"
        return 0.0, f"unknown GPU {name!r}: no peak in the table, MFU not reported"
    return cpu_matmul_flops(precision, cache_dir), "matmul probe"


BF16_MIN_SPEEDUP = 1.5
"""``precision: auto`` on a CPU takes bf16 only when its bf16 matmuls are at least this much faster
than fp32: the rest of a mixed-precision step (casts, fp32 norms and softmax statistics) does not
speed up, and on the 6M-parameter benchmark model a 4-6x faster bf16 matmul gave 1.2-1.8x the
fp32 training speed. Below this margin, bf16 training would not beat fp32."""


def resolve_precision(requested: str, device: torch.device, cache_dir: Path | None = None) -> tuple[Precision, str]:
    """(precision, why). ``auto``: bf16 on Ampere+ GPUs, fp16 + loss scaling on older GPUs; on a CPU
    bf16 only where it is native and its matmuls measure ``BF16_MIN_SPEEDUP`` x fp32, else fp32."""
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("train.precision=bf16: this GPU has no bf16 support; use fp16, fp32 or auto")
        return PRECISIONS[requested], "as configured"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return PRECISIONS["bf16"], f"auto: compute capability {major}.{minor} has bf16 tensor cores"
        return PRECISIONS["fp16"], f"auto: compute capability {major}.{minor} has no bf16; fp16 with loss scaling"
    if device.type != "cpu":
        return PRECISIONS["fp32"], f"auto: fp32 on {device.type}"
    if not cpu_has_native_bf16():
        return PRECISIONS["fp32"], "auto: this CPU has no native bf16 (AVX512-BF16 or AMX); bf16 would be emulated and slower"
    speedup = cpu_matmul_flops("bf16", cache_dir) / cpu_matmul_flops("fp32", cache_dir)
    if speedup < BF16_MIN_SPEEDUP:
        return PRECISIONS["fp32"], (
            f"auto: native bf16, but its matmuls measured only {speedup:.1f}x fp32 here (bf16 needs "
            f"{BF16_MIN_SPEEDUP}x to train faster); set train.precision=bf16 to use it anyway"
        )
    return PRECISIONS["bf16"], f"auto: native bf16, matmuls {speedup:.1f}x fp32 on this CPU"


def cpu_matmul_flops(precision: str, cache_dir: Path | None = None) -> float:
    """Measured FLOP/s of a large matmul on this CPU in ``precision`` with the current thread count;
    cached per machine, thread count and torch version (the probe takes about a second)."""
    threads = torch.get_num_threads()
    key = f"{platform.node()}-{platform.processor() or platform.machine()}-{threads}t-{precision}-torch{torch.__version__}"
    cache = (cache_dir or default_cache_dir()) / "cpu_peak.json"
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except ValueError:
            table = {}
    if key in table:
        return float(table[key])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    # fp16 has no CPU kernels (emulated, ~1000x slower than fp32): a small matrix keeps the probe short
    value = measure_matmul(dtype, 256 if dtype is torch.float16 else 1024)
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
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def configure_backends(device: torch.device) -> None:
    """Global speed switches that do not change results beyond the chosen precision."""
    if device.type == "cuda":
        # TF32 matmuls on Ampere+: ~8x fp32 throughput for the few fp32 matmuls left under autocast
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this run so far: CUDA allocated on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


def describe(device: torch.device) -> str:
    """One line about the device, for the console."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"cpu ({torch.get_num_threads()} threads)"


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory a run can still take: free CUDA memory on GPU, MemAvailable of the system on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
