"""Hardware profiles: what a device holds and computes, for ``trainforge plan`` and for MFU.

One table serves both. Peak FLOP/s are dense (no 2:4 sparsity) tensor-core figures from the
vendor's datasheets and architecture whitepapers; "fp32" is the non-tensor-core rate and "tf32"
the tensor-core rate for fp32 matmuls. GeForce cards are listed at their FP16/BF16 rate with
FP32 accumulation, which is what mixed-precision training uses.

Sources (figures read from these documents):
- NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe, 80 GB)
- NVIDIA H200 Tensor Core GPU datasheet (SXM, 141 GB)
- NVIDIA A100 Tensor Core GPU datasheet (40 GB and 80 GB SXM)
- NVIDIA L40S datasheet; NVIDIA L4 datasheet; NVIDIA A10 datasheet (A10G is AWS's A10 variant:
  same GA102 chip and memory size; NVIDIA publishes no separate sheet, so A10 figures are used)
- NVIDIA Ada Lovelace architecture whitepaper (RTX 4090, RTX 4070)
- NVIDIA Ampere GA102 whitepaper (RTX 3090)
- NVIDIA T4 datasheet; NVIDIA V100 datasheet (SXM2 32 GB)
- NVIDIA Turing architecture whitepaper (RTX 2080 Ti, TU102) and GTX 1660 (TU116) specifications
- NVIDIA Pascal GP104 whitepaper (GTX 1080: FP16 at 1/64 of the FP32 rate, no tensor cores)
- NVIDIA GeForce RTX 3060 / 3080 specifications and the GA102 whitepaper
- NVIDIA GeForce RTX 4060 / 4060 Ti / 4080 SUPER specifications ("AI TOPS", FP8 sparse: dense FP16 with
  FP32 accumulate derived as a quarter, then halved for GeForce accumulation)
- NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090)
- NVIDIA RTX A5000 and RTX A6000 datasheets

Fixed costs of a GPU process, not in any tensor: the CUDA context with cuBLAS/cuDNN handles
(``GPU_CONTEXT_GIB``, commonly 0.4-0.8 GiB with CUDA 12) and the caching allocator's rounding and
fragmentation (``ALLOCATOR_OVERHEAD``, reserved over allocated). Both are assumptions until
``trainforge selftest``/``plan --measure`` has measured them on the user's GPU; they are stated
with every prediction.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

GIB = 1024**3
GPU_CONTEXT_GIB = 0.6
ALLOCATOR_OVERHEAD = 0.08  # reserved memory is about 8% above the peak of live tensors in steady training
# the same with expandable segments (trainforge's CUDA default, hardware/allocator.py): reserved over allocated was
# 1.000 (Llama-1B full) and 1.006 (8B LoRA) on an H200 (2026-11-27), against 1.016 and 1.075 for HF's runs
EXPANDABLE_ALLOCATOR_OVERHEAD = 0.02
GPU_OP_OVERHEAD_S = 8e-6  # eager PyTorch: Python, dispatcher and kernel launch per op (a few microseconds)
GPU_MATMUL_EFFICIENCY = 0.7  # share of datasheet peak large training GEMMs reach
GPU_BANDWIDTH_EFFICIENCY = 0.8  # share of datasheet bandwidth elementwise kernels reach


@dataclass(frozen=True)
class HardwareProfile:
    """One device: memory, peak FLOP/s per precision, memory bandwidth, bf16 support."""

    name: str  # short name, as --hardware takes it
    title: str
    memory_gib: float
    peak_tflops: dict[str, float]  # keys: bf16, fp16, tf32, fp32
    bandwidth_gbs: float  # GB/s
    bf16: bool
    kind: str = "gpu"  # gpu | cpu
    source: str = ""
    aliases: tuple[str, ...] = ()
    fixed_gib: float = GPU_CONTEXT_GIB  # process memory that is not tensors
    load_fixed_gib: float | None = None  # the same before the first step (CPU: no loader or metrics yet); None: fixed_gib
    compact_fixed_gib: float | None = None  # the same with a CPU's compact heap (hardware/heap.py); None: fixed_gib
    allocator_overhead: float = ALLOCATOR_OVERHEAD
    op_overhead_s: float = GPU_OP_OVERHEAD_S
    matmul_efficiency: float = GPU_MATMUL_EFFICIENCY
    bandwidth_efficiency: float = GPU_BANDWIDTH_EFFICIENCY
    measured: dict[str, float] = field(default_factory=dict)  # what a local probe measured, for the report
    host_link_gbs: float = 32.0  # GB/s each way between host and device: PCIe 4.0 x16 (5.0 x16: 64; 3.0: 16)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def peak_flops(self, precision: str, tf32: bool = True) -> float:
        """Peak FLOP/s for matmuls in ``precision`` (bf16 | fp16 | fp32 | fp8); fp32 on tensor cores as TF32 when
        allowed; fp8 twice the bf16 rate on GPUs with FP8 tensor cores (every Ada, Hopper and Blackwell
        datasheet here: the same accumulation, twice the rate), else the bf16 rate (emulated)."""
        if precision == "fp32" and tf32 and self.peak_tflops.get("tf32"):
            return self.peak_tflops["tf32"] * 1e12
        if precision == "fp8":
            return (2 if self.name in FP8_TENSOR_CORES else 1) * self.peak_flops("bf16" if self.bf16 else "fp16")
        return self.peak_tflops.get(precision, self.peak_tflops["fp32"]) * 1e12


def _gpu(name: str, title: str, memory_gib: float, bf16: float | None, fp16: float, tf32: float | None, fp32: float,
         bandwidth_gbs: float, source: str, aliases: tuple[str, ...] = (), link: float = 32.0) -> HardwareProfile:
    """``link``: host link GB/s each way (the datasheets' PCIe generation: 5.0 x16 64, 4.0 x16 32, 3.0 x16 16)."""
    tflops = {"fp16": fp16, "fp32": fp32, **({"bf16": bf16} if bf16 else {}), **({"tf32": tf32} if tf32 else {})}
    return HardwareProfile(name, title, memory_gib, tflops, bandwidth_gbs, bf16 is not None, source=source, aliases=aliases,
                           host_link_gbs=link)


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        _gpu("h100", "NVIDIA H100 SXM5 80GB", 80, 989.4, 989.4, 494.7, 66.9, 3350, "H100 datasheet (SXM5)", ("h100-sxm", "h100-80gb"), link=64.0),
        _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, 756.0, 756.0, 378.0, 51.2, 2000, "H100 datasheet (PCIe)", link=64.0),
        _gpu("h200", "NVIDIA H200 SXM 141GB", 141, 989.4, 989.4, 494.7, 66.9, 4800, "H200 datasheet (SXM)", ("h200-sxm",), link=64.0),
        _gpu("a100-80gb", "NVIDIA A100 SXM 80GB", 80, 312.0, 312.0, 156.0, 19.5, 2039, "A100 datasheet (80GB SXM)", ("a100",)),
        _gpu("a100-40gb", "NVIDIA A100 SXM 40GB", 40, 312.0, 312.0, 156.0, 19.5, 1555, "A100 datasheet (40GB SXM)"),
        _gpu("l40s", "NVIDIA L40S 48GB", 48, 362.05, 362.05, 183.0, 91.6, 864, "L40S datasheet"),
        _gpu("l4", "NVIDIA L4 24GB", 24, 121.0, 121.0, 60.0, 30.3, 300, "L4 datasheet"),
        _gpu("a10g", "NVIDIA A10G 24GB", 24, 125.0, 125.0, 62.5, 31.2, 600, "A10 datasheet (A10G: AWS variant)", ("a10",)),
        _gpu("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 24, 165.2, 165.2, 82.6, 82.6, 1008, "Ada Lovelace whitepaper", ("4090",)),
        _gpu("rtx4070", "NVIDIA GeForce RTX 4070 12GB", 12, 58.3, 58.3, 29.1, 29.1, 504, "Ada Lovelace whitepaper", ("4070",)),
        _gpu("rtx3090", "NVIDIA GeForce RTX 3090 24GB", 24, 71.0, 71.0, 35.6, 35.6, 936, "GA102 whitepaper", ("3090",)),
        # consumer and workstation cards of the fine-tuning guides (GeForce: FP16/BF16 tensor rate with FP32
        # accumulate, dense; where NVIDIA publishes only "AI TOPS" (FP8/FP4, sparse), the dense FP16 rate is
        # derived by halving per step down to FP16 and, on GeForce, once more for FP32 accumulation)
        _gpu("rtx5090", "NVIDIA GeForce RTX 5090 32GB", 32, 209.5, 209.5, 104.8, 104.8, 1792,
             "RTX Blackwell whitepaper (RTX 5090)", ("5090",), link=64.0),
        _gpu("rtx4080-super", "NVIDIA GeForce RTX 4080 SUPER 16GB", 16, 104.4, 104.4, 52.2, 52.2, 736,
             "RTX 4080 SUPER specs (836 AI TOPS, derived)", ("4080-super", "rtx4080s", "4080s")),
        _gpu("rtx4060ti-16gb", "NVIDIA GeForce RTX 4060 Ti 16GB", 16, 44.1, 44.1, 22.1, 22.1, 288,
             "RTX 4060 Ti specs (353 AI TOPS, derived)", ("rtx4060ti", "4060ti", "4060-ti"), link=16.0),
        _gpu("rtx4060", "NVIDIA GeForce RTX 4060 8GB", 8, 30.2, 30.2, 15.1, 15.1, 272,
             "RTX 4060 specs (242 AI TOPS, derived)", ("4060",), link=16.0),
        _gpu("rtx3080", "NVIDIA GeForce RTX 3080 10GB", 10, 59.5, 59.5, 29.8, 29.8, 760, "GA102 whitepaper (RTX 3080)", ("3080",)),
        _gpu("rtx3060", "NVIDIA GeForce RTX 3060 12GB", 12, 25.6, 25.6, 12.8, 12.7, 360,
             "RTX 3060 specs (GA106; 101 sparse FP16 tensor TFLOPS, derived)", ("3060", "rtx3060-12gb")),
        _gpu("rtx-a6000", "NVIDIA RTX A6000 48GB", 48, 154.8, 154.8, 77.4, 38.7, 768, "RTX A6000 datasheet", ("a6000", "rtxa6000")),
        _gpu("rtx-a5000", "NVIDIA RTX A5000 24GB", 24, 111.1, 111.1, 55.6, 27.8, 768, "RTX A5000 datasheet", ("a5000", "rtxa5000")),
        _gpu("rtx2080ti", "NVIDIA GeForce RTX 2080 Ti 11GB", 11, None, 53.8, None, 13.4, 616,
             "Turing TU102 whitepaper (RTX 2080 Ti reference)", ("2080ti", "2080-ti"), link=16.0),
        # no tensor cores: the 1660 runs FP16 at twice its FP32 rate, Pascal GeForce at 1/64 of it
        _gpu("gtx1660", "NVIDIA GeForce GTX 1660 6GB", 6, None, 10.1, None, 5.0, 192, "Turing TU116 specs (GTX 1660)",
             ("1660",), link=16.0),
        _gpu("gtx1080", "NVIDIA GeForce GTX 1080 8GB", 8, None, 0.14, None, 8.9, 320, "Pascal GP104 whitepaper (GTX 1080)",
             ("1080",), link=16.0),
        _gpu("t4", "NVIDIA T4 16GB", 16, None, 65.0, None, 8.1, 320, "T4 datasheet", link=16.0),
        _gpu("v100", "NVIDIA V100 SXM2 32GB", 32, None, 125.0, None, 15.7, 900, "V100 datasheet (SXM2)", ("v100-32gb",), link=16.0),
    )
}
FP8_TENSOR_CORES = frozenset({  # compute capability 8.9+ (Ada, Hopper, Blackwell): train.fp8 can run
    "h100", "h100-pcie", "h200", "l40s", "l4", "rtx4090", "rtx4070", "rtx5090", "rtx4080-super", "rtx4060ti-16gb", "rtx4060",
})


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower()).replace("geforce-", "").replace("nvidia-", "")


def find_profile(name: str) -> HardwareProfile:
    """The profile a short, case-insensitive name (or alias) means; ValueError naming the choices."""
    key = _norm(name)
    flat = key.replace("-", "")  # "RTX 4060 Ti", "rtx-4060-ti" and "rtx4060ti" are one name
    for p in PROFILES.values():
        if flat in {n.replace("-", "") for n in (p.name, *p.aliases)}:
            return p
    close = difflib.get_close_matches(key, [*PROFILES, *(a for p in PROFILES.values() for a in p.aliases)], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"--hardware {name!r}: unknown profile{hint} (known: {', '.join(PROFILES)}, or 'this'; --hardware list shows them)")


def profile_for_gpu_name(device_name: str) -> HardwareProfile | None:
    """The profile of a CUDA device by the name torch reports (``NVIDIA H100 80GB HBM3`` -> h100)."""
    n = device_name.lower()
    rules = (
        ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100"), ("a100-sxm4-40gb", "a100-40gb"),
        ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"), ("l40s", "l40s"), ("l4", "l4"), ("a10", "a10g"),
        ("5090", "rtx5090"), ("4090", "rtx4090"), ("4080 super", "rtx4080-super"), ("4070", "rtx4070"),
        ("4060 ti", "rtx4060ti-16gb"), ("4060", "rtx4060"), ("3090", "rtx3090"), ("3080", "rtx3080"), ("3060", "rtx3060"),
        ("a6000", "rtx-a6000"), ("a5000", "rtx-a5000"), ("2080 ti", "rtx2080ti"), ("1660", "gtx1660"), ("1080", "gtx1080"),
        ("t4", "t4"), ("v100", "v100"),
    )
    for fragment, name in rules:
        if fragment in n:
            return PROFILES[name]
    return None


def describe_profiles() -> list[dict]:
    """Every profile as a row for ``--hardware list``."""
    return [
        {
            "name": p.name,
            "title": p.title,
            "memory_gib": p.memory_gib,
            "bf16_tflops": p.peak_tflops.get("bf16"),
            "fp16_tflops": p.peak_tflops["fp16"],
            "tf32_tflops": p.peak_tflops.get("tf32"),
            "fp32_tflops": p.peak_tflops["fp32"],
            "bandwidth_gbs": p.bandwidth_gbs,
            "bf16": p.bf16,
            "source": p.source,
        }
        for p in PROFILES.values()
    ]
