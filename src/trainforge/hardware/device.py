"""What the machine can do: device, native precisions, memory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.run import ConfigError
from ..config.data import default_cache_dir
from ..config.errors import shown


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
        raise ConfigError(f"train.device={requested!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    return device


def torch_release(version: str | None = None) -> tuple[int, ...]:
    """(major, minor) of ``version`` (default: this torch), for the features that moved between releases."""
    return tuple(int(p) for p in re.findall(r"\d+", version or torch.__version__)[:2])


def cuda_has_native_bf16(device: torch.device) -> bool:
    """bf16 tensor cores (compute capability 8.0+). torch's ``is_bf16_supported()`` also says yes where
    bf16 is only emulated (T4, V100), and Triton's kernels (Liger, FlexAttention) refuse bf16 there."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def fp32_out_addmm_in(version: str | None = None, fake: bool = False) -> bool:
    """Whether torch ``version``'s CUDA ``addmm(..., out_dtype=fp32)`` takes an fp32 ``self`` beside bf16/fp16
    operands (a GEMM accumulating straight into an fp32 buffer). The overload exists from 2.8, but until
    2.10 (pytorch#167931) the kernel refuses that ("self and mat2 must have the same dtype").
    ``fake``: on the fake tensors a plan traces, where until 2.13 (pytorch#179634) a decomposition
    registered for every addmm overload bound ``out_dtype`` to ``beta`` and raised."""
    return torch_release(version) >= ((2, 13) if fake else (2, 10))


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and _cpu_flags() & {"avx512_bf16", "amx_bf16"} != set()
    except (AttributeError, RuntimeError):
        return False


def emulated_precision(precision: str, native_bf16: bool) -> tuple[str, str] | None:
    """On a CPU: (what is wrong, what to do) when ``precision`` runs emulated there, else None.
    Training and ``plan`` say the same."""
    if precision == "fp16":
        return ("fp16 on a CPU is emulated and slow: it checks the fp16 + loss-scaling path that older GPUs take",
                "use bf16 or fp32 to train (train.precision: auto)")
    if precision == "bf16" and not native_bf16:
        return ("bf16 on this CPU is emulated (no AVX512-BF16 or AMX), many times slower than fp32: it checks the path GPUs take",
                "set train.precision: auto (fp32 here) to train")
    return None


def _cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line of /proc/cpuinfo ('' where there is none, e.g. off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo_field("flags").split())


def cpu_identity() -> str:
    """The CPU model and whether it has native bf16: a VM or container keeps its host name when it
    moves to other hardware, and a figure measured on one CPU must not be reused on another."""
    model = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    flags = _cpu_flags()
    # the model name alone can be generic in a VM ("AMD EPYC"): the widest matmul ISA tells them apart
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "")
    return "-".join(model.split()) + (f"+{isa}" if isa else "")


def peak_flops(device: torch.device, precision: str, cache_dir: Path | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for this device in this precision."""
    if device.type == "cuda":
        from .profiles import profile_for_gpu_name

        name = torch.cuda.get_device_name(device)
        profile = profile_for_gpu_name(name)
        if profile is None:
            return 0.0, f"unknown GPU {name!r}: no profile in trainforge/hardware/profiles.py, MFU not reported"
        return profile.peak_flops(precision, torch.backends.cuda.matmul.allow_tf32), f"profile {profile.name}"
    probed, where = cpu_peak_precision(precision)
    return cpu_matmul_flops(probed, cache_dir), where


def cpu_peak_precision(precision: str) -> tuple[str, str]:
    """(the precision whose matmul probe is a CPU's peak for ``precision``, where the figure comes from). An emulated
    precision (fp16 anywhere, bf16 without native support) computes in fp32 underneath: its own probe times the
    emulation, and dividing by it gave MFUs over 200%; the fp32 probe is what the machine can do."""
    if emulated_precision(precision, cpu_has_native_bf16()):
        return "fp32", f"fp32 matmul probe: {precision} is emulated on this CPU"
    return precision, "matmul probe"


BF16_MIN_SPEEDUP = 1.5
"""``precision: auto`` on a CPU takes bf16 only when its bf16 matmuls are at least this much faster
than fp32: the rest of a mixed-precision step (casts, fp32 norms and softmax statistics) does not
speed up, and on the 6M-parameter benchmark model a 4-6x faster bf16 matmul gave 1.2-1.8x the
fp32 training speed. Below this margin, bf16 training would not beat fp32."""


def resolve_precision(requested: str, device: torch.device, cache_dir: Path | None = None) -> tuple[Precision, str]:
    """(precision, why). ``auto``: bf16 on Ampere+ GPUs, fp16 + loss scaling on older GPUs; on a CPU
    bf16 only where it is native and its matmuls measure ``BF16_MIN_SPEEDUP`` x fp32, else fp32."""
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and not cuda_has_native_bf16(device):
            raise ConfigError(
                f"train.precision=bf16: {torch.cuda.get_device_name(device)} has no bf16 tensor cores (compute capability "
                "8.0+: A100, L4, RTX 30xx and newer); use fp16, fp32 or auto"
            )
        return PRECISIONS[requested], "as configured"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return PRECISIONS["bf16"], f"auto: compute capability {major}.{minor} has bf16 tensor cores"
        if (major, minor) in ((6, 1), (6, 2)):  # Pascal GeForce/Jetson: fp16 math at 1/64 of the fp32 rate
            return PRECISIONS["fp32"], f"auto: compute capability {major}.{minor} runs fp16 slower than fp32"
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


def cpu_matmul_flops(precision: str, cache_dir: Path | None = None, again: bool = False) -> float:
    """Measured FLOP/s of a large matmul on this CPU in ``precision`` with the current thread count;
    cached per machine, thread count and torch version (the probe takes about a second). ``again``:
    measure now and replace the cached figure."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    # fp16 has no CPU kernels (emulated, ~1000x slower than fp32), nor has bf16 without AVX512-BF16/AMX:
    # a small matrix keeps the probe short (it cost 30-70 s at 1024 on a loaded 2-core AVX2 machine)
    emulated = dtype is torch.float16 or (dtype is torch.bfloat16 and not cpu_has_native_bf16())
    n = 256 if emulated else 1024
    value = cached_probe(precision, lambda: measure_matmul(dtype, n), cache_dir, again=again)
    # a quick check of the cached figure (a few ms): a half-size matmul does not beat the peak by STALE_MARGIN, so
    # where it does, the figure was taken while other work held the cores (and MFU would read over 100%)
    if not again and measure_matmul(dtype, n // 2, reps=2) > STALE_MARGIN * value:
        value = cached_probe(precision, lambda: measure_matmul(dtype, n), cache_dir, again=True)
    return value


STALE_MARGIN = 1.25


BUSY_LOAD_PER_CORE = 0.5
"""A probe taken while the 1-minute load average per core was above this shared the cores with other
work, so it reads low (a 2-thread matmul waits on a busy core at every barrier)."""


def load_per_core() -> float:
    """The 1-minute load average per core (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def cached_probe(name: str, measure, cache_dir: Path | None = None, better=max, again: bool = False) -> float:
    """``measure()`` once per machine, CPU model, thread count and torch version, kept in ``cpu_peak.json``
    with the load it was taken under. A figure taken on a busy machine is taken again once the machine
    is quieter, keeping the ``better`` of the two (``max`` for rates, ``min`` for costs): a peak measured
    while a test suite ran must not price every later plan and MFU on this machine. ``again``: measure now
    and keep this figure, whatever was cached (a run found the cached one impossible: MFU above 100%)."""
    threads = torch.get_num_threads()
    key = f"{platform.node()}-{cpu_identity()}-{threads}t-{name}-torch{torch.__version__}"
    cache = (cache_dir or default_cache_dir()) / "cpu_peak.json"
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except ValueError:
            table = {}
    entry = table.get(key)
    if isinstance(entry, (int, float)):  # written before the load was kept: taken as measured on a quiet machine
        entry = {"value": float(entry), "load_per_core": 0.0}
    load = load_per_core()
    if not again and entry is not None and (entry["load_per_core"] <= BUSY_LOAD_PER_CORE or load >= entry["load_per_core"]):
        return float(entry["value"])
    value = measure()
    if entry is not None and not again:
        value = better(value, float(entry["value"]))
        load = min(load, entry["load_per_core"])
    table[key] = {"value": value, "load_per_core": round(load, 3)}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(table, indent=1))
    except OSError:
        pass  # a read-only home only costs re-measuring next time
    return value


def measure_bandwidth(n_bytes: int = 256 * 2**20) -> float:
    """Best-of-5 bytes/s of copying a tensor larger than any cache (read + write counted)."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def measure_op_overhead(n: int = 400) -> float:
    """Seconds an eager op costs beyond its arithmetic: a chain of tiny ops recorded by autograd
    and run backward, divided by the ops run (forward and backward)."""
    x = torch.ones(16, requires_grad=True)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y = x
        for _ in range(n):
            y = y * 1.0001
        y.sum().backward()
        best = min(best, time.perf_counter() - t)
    return best / (2 * n)


def measure_matmul(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` FLOP/s of an n x n matmul. Uses its own generator: the run's random stream
    (dropout, data order) must not depend on whether this probe ran."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def configure_backends(device: torch.device) -> None:
    """Global speed switches that do not change results beyond the chosen precision; on CUDA, ``device``
    becomes the current GPU."""
    if device.type == "cuda" and device.index is not None:  # plain "cuda" is the current GPU already
        # kernels launched without an explicit device (Triton's: Liger, compiled code; events, streams)
        # take the current GPU: with train.device cuda:1 in one process that must be cuda:1, not cuda:0
        torch.cuda.set_device(device)
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
    return f"cpu ({thread_count()})"


def thread_count() -> str:
    """torch's CPU threads, as the console says them: "1 thread", "8 threads"."""
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n != 1 else ''}"


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


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_memory_bytes(torch.device("cpu"))


CPU_RUN_EXTRA_GIB = 0.15
"""A training process's resident memory beyond the planner's own at the same point (token store
pages, tokenizer and data preparation, loader, metrics, freed blocks glibc keeps): 0.15 GiB by 6M and
30M Llamas' full and LoRA runs here (2026-11-28; the planner holds transformers' modeling code by now, so this
is 0.15 under the 0.3 measured before it did). LoRA runs hold ``CPU_ADAPTER_EXTRA_GIB`` more, QLoRA
``CPU_QLORA_EXTRA_GIB`` more again."""
CPU_ADAPTER_EXTRA_GIB = 0.15  # loading a pretrained base through PEFT
CPU_QLORA_EXTRA_GIB = 0.08  # bitsandbytes' CPU backend
CPU_ALLOCATOR_OVERHEAD = 0.15
"""Process peak RSS over the peak of live tensors on a CPU: freed blocks glibc keeps mapped."""
CPU_COMPACT_RUN_EXTRA_GIB = 0.05
CPU_COMPACT_ADAPTER_EXTRA_GIB = 0.05
CPU_COMPACT_HEAP_OVERHEAD = 0.03
"""The run's extra, the adapters' and the step's overhead with ``train.compact_heap`` on (hardware/heap.py): blocks of
1 MiB and more go back to the system when freed, so what stays is live data and small blocks. By 6M and 30M Llamas,
full and LoRA with checkpointing, and a 4 x 256 LoRA Llama at 13,056 tokens: plan within 1-2% of peak RSS."""

MEMORY_CAP_ENV = "TRAINFORGE_MEMORY_GIB"
"""Caps the memory ``plan`` and the auto settings assume this machine has (to leave room for other jobs)."""


def memory_cap_gib(found: float) -> float:
    """``found`` GiB, or less when $TRAINFORGE_MEMORY_GIB says so; a ``ConfigError`` (exit 2) naming the
    variable and its value when that is not a positive number."""
    cap = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if not cap:
        return found
    try:
        gib = float(cap)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ConfigError(
            f"${MEMORY_CAP_ENV}={shown(cap)}: expected a positive number of GiB, e.g. 12 or 7.5 (the most memory plan "
            f"and the run's automatic settings assume this machine has); fix it, or unset it to use all the memory found"
        )
    return min(found, gib)


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, what they are) a run on ``device`` can have at most, as ``plan`` counts them: the GPU's total
    memory, or on a CPU what the system has available plus what this process holds; capped by
    $TRAINFORGE_MEMORY_GIB. None where the system does not say."""
    if device.type == "cuda":
        found, where = torch.cuda.get_device_properties(device).total_memory, f"the GPU ({torch.cuda.get_device_name(device)})"
    else:
        available = available_memory_bytes(device)
        if available is None:
            return None, "system memory"
        found, where = available + process_rss_bytes(), "system memory available to this process"
    capped = int(memory_cap_gib(found / 2**30) * 2**30)
    return capped, where + (f", capped by ${MEMORY_CAP_ENV}" if capped < found else "")


def this_profile(device: torch.device, cache_dir: Path | None = None, timing: bool = True):
    """The hardware profile of the machine at hand: a GPU's table entry with its real memory, or
    this CPU as measured (matmul peak per precision, copy bandwidth, per-op overhead; cached).
    ``timing=False``: memory only (no probes), for fitting a run."""
    from dataclasses import replace

    from .profiles import GIB, HardwareProfile, profile_for_gpu_name

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        known = profile_for_gpu_name(props.name)
        if known is None:
            raise ValueError(f"no hardware profile for {props.name!r}: add it to trainforge/hardware/profiles.py, or plan with --hardware NAME")
        return replace(known, name="this", title=f"{props.name} (this machine)", memory_gib=memory_cap_gib(props.total_memory / GIB))
    if timing:
        tflops = {p: cpu_matmul_flops(p, cache_dir) / 1e12 for p in ("fp32", "bf16", "fp16")}
        bandwidth = cached_probe("bandwidth", measure_bandwidth, cache_dir)
        overhead = cached_probe("op-overhead", measure_op_overhead, cache_dir, better=min)
    else:
        tflops, bandwidth, overhead = {"fp32": 0.0}, 0.0, 0.0
    # every training process holds transformers' modeling code (0.16 GiB of RSS here); a plan run before anything
    # imported it measured its own RSS that much under a run's (plan --longest then overshot a 1.5 GiB cap 2.3x)
    import transformers.modeling_utils  # noqa: F401

    memory, held = available_memory_bytes(device) or 0, process_rss_bytes() / GIB  # what this process holds now
    return HardwareProfile(
        name="this",
        title=f"{platform.processor() or platform.machine()} CPU, {thread_count()} (this machine)",
        memory_gib=memory_cap_gib(memory / GIB + held),  # free now plus what this process holds
        peak_tflops=tflops,
        bandwidth_gbs=bandwidth / 1e9,
        bf16=cpu_has_native_bf16(),
        kind="cpu",
        source="measured here: matmul, copy-bandwidth and per-op probes (cached in cpu_peak.json)",
        # Python, torch and transformers (loaded by now), plus what a training process holds beyond them
        fixed_gib=held + CPU_RUN_EXTRA_GIB,
        # until the first step a training process holds what the planner holds: the run's extras come with the steps
        # (bench_memory, 170M Llama: 0.38-0.45 GiB at the end of loading without casts, the planner 0.33 + PEFT's)
        load_fixed_gib=held,
        compact_fixed_gib=held + CPU_COMPACT_RUN_EXTRA_GIB,
        allocator_overhead=CPU_ALLOCATOR_OVERHEAD,
        op_overhead_s=overhead,
        matmul_efficiency=1.0,  # the probes measure what this CPU reaches, not a datasheet peak
        bandwidth_efficiency=1.0,
        measured={"matmul_tflops": tflops, "bandwidth_gbs": bandwidth / 1e9, "op_overhead_us": overhead * 1e6},
    )
