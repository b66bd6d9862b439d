"""What the machine can do: device, native precisions, memory."""

from __future__ import annotations

import contextlib
import resource
import sys
from dataclasses import dataclass

import torch


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


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """``auto``: bf16 where native (Ampere+ GPU, bf16 CPU), fp16+scaler on older GPUs, fp32 otherwise."""
    if requested != "auto":
        if requested == "fp16" and device.type == "cpu":
            raise RuntimeError("train.precision=fp16 is not supported on CPU; use bf16, fp32 or auto")
        if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("train.precision=bf16: this GPU has no bf16 support; use fp16, fp32 or auto")
        return PRECISIONS[requested]
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return PRECISIONS["bf16"] if major >= 8 else PRECISIONS["fp16"]
    if device.type == "cpu" and cpu_has_native_bf16():
        return PRECISIONS["bf16"]
    return PRECISIONS["fp32"]


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
