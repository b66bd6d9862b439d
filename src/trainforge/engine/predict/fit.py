"""Fit a run to a machine: predicted peak memory of a step (traced, see trace.py), the largest
micro-batch that fits, and whether activation checkpointing is needed.

Shared by ``trainforge plan`` (any hardware profile) and ``train`` (this machine), so both
decide alike. Process memory = tensors x (1 + the allocator's overhead) + the process's fixed
cost (CUDA context on a GPU; Python, torch and transformers on a CPU), from the profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...config.run import RunConfig
from ...config.preference import run_reference
from ...hardware.device import Precision
from ...hardware.profiles import EXPANDABLE_ALLOCATOR_OVERHEAD, GIB, HardwareProfile
from .memory import MemoryEstimate, estimate_memory
from .rollout_memory import micro_batch_unit, predict_rollout, rows_that_fit
from .qlora_standin import quantize_base_4bit
from .trace import StepTrace, trace_training_step

FIT_MARGIN = 0.90  # micro_batch_size: auto and checkpointing: auto keep the predicted process peak under this share
AUTO_MAX_MICRO_BATCH = 256  # auto never picks more rows per pass than this (nor more than the global batch)
QUICK_SHARE = 0.25  # the rough estimate below this share of the device: fits without tracing


@dataclass
class MemoryPrediction:
    """Predicted peak memory of one training step on one process, in bytes."""

    parts: dict[str, int]  # the learning step's: weights, grads, optimizer, activations, temporaries (+ ddp_buckets, ...)
    tensors: int  # peak of live tensors (grpo: the larger of the learning step's and the rollout's)
    process: int  # tensors with the allocator's overhead, plus the fixed cost
    capacity: int  # the device's memory
    micro_batch_size: int
    activation_checkpointing: bool
    trace: StepTrace | None = field(default=None, repr=False)
    rollout: dict[str, int] | None = None  # grpo: the rollout phase's parts, kv_cache among them (rollout_memory.py)
    rollout_rows: int = 0  # grpo: the completions the rollout samples at once
    scale: float = 1.0  # process bytes per tensor byte (the allocator's overhead)
    fixed: float = 0.0  # the process's fixed cost
    compact_heap: bool = False  # a CPU run's heap gives freed blocks back (hardware/heap.py): priced in scale and fixed
    heap_share: float | None = None  # CPU, compact_heap auto: the default heap's predicted share of memory (it decides)

    @property
    def share(self) -> float:
        return self.process / self.capacity if self.capacity else 0.0

    def fits(self, margin: float = 1.0) -> bool:
        return self.process <= margin * self.capacity

    def process_of(self, tensors: int) -> int:
        """The process's bytes when ``tensors`` bytes of tensors are live."""
        return int(tensors * self.scale + self.fixed)

    @property
    def phases(self) -> dict[str, int]:
        """Tensors at the peak of each phase of the step: the learning step, and a grpo run's rollout."""
        out = {"learning": sum(self.parts.values())}
        if self.rollout is not None:
            out["rollout"] = sum(self.rollout.values())
        return out


def predict_memory(
    cfg: RunConfig,
    tokenizer,
    precision: Precision,
    profile: HardwareProfile,
    micro_batch_size: int,
    activation_checkpointing: bool,
    grad_accum: int = 1,
    world_size: int = 1,
    mode: str = "ddp",
) -> MemoryPrediction:
    """Trace one step of ``cfg`` at these settings and price it on ``profile`` for one of ``world_size`` processes."""
    device_type = "cpu" if profile.kind == "cpu" else "cuda"
    trace = trace_training_step(cfg, tokenizer, precision, micro_batch_size, activation_checkpointing, grad_accum, device_type,
                                planned_kernels(cfg, profile))
    parts = dict(trace.parts)
    if world_size > 1 and mode == "fsdp":
        # FSDP2 shards weights, gradients and optimizer state; a layer is gathered whole for its
        # forward and backward (the next one prefetched), and its gradients reduce-scattered
        for k in ("weights", "grads", "optimizer"):
            parts[k] = -(-parts[k] // world_size)
        parts["fsdp_gather"] = 2 * trace.largest_layer + trace.largest_layer
    elif world_size > 1:
        parts["ddp_buckets"] = trace.trainable_grads  # DDP reduces gradients through flat bucket copies
    if run_reference(cfg) == "model":
        parts["reference"] = trace.parts["weights"]  # a frozen copy of the starting weights, whole on every process
    rollout = predict_rollout(cfg, tokenizer, precision, micro_batch_size, grad_accum, world_size, parts)
    tensors = max(sum(parts.values()), sum(rollout[0].values()) if rollout else 0)
    # a CPU heap maps each block of 32 MiB or more on its own and unmaps it when freed: no overhead on those
    mapped = min(trace.mapped, tensors) if profile.kind == "cpu" else 0

    def priced(compact: bool) -> tuple[int, float, float]:
        scale, fixed = 1 + allocator_overhead(profile, compact), fixed_bytes(cfg, profile, compact=compact)
        return int((tensors - mapped) * scale + mapped + fixed), scale, fixed

    compact = heap_is_compact(cfg, profile, activation_checkpointing)
    process, scale, fixed = priced(compact)
    share = None
    if not compact and profile.kind == "cpu" and cfg.train.compact_heap == "auto" and profile.memory_bytes:
        share = process / profile.memory_bytes  # the default heap's peak: past COMPACT_SHARE, auto takes the compact one
        if heap_is_compact(cfg, profile, activation_checkpointing, share):
            compact = True
            process, scale, fixed = priced(True)
    return MemoryPrediction(parts, tensors, process, profile.memory_bytes, micro_batch_size,
                            activation_checkpointing, trace, *(rollout or (None, 0)), scale, fixed, compact, share)


def heap_is_compact(cfg: RunConfig, profile: HardwareProfile, activation_checkpointing: bool,
                    predicted_share: float | None = None) -> bool:
    """Whether the run's CPU heap gives freed blocks back (``train.compact_heap``, hardware/heap.py) at these settings
    (``predicted_share``: the default heap's predicted share of memory, where it is known)."""
    from ...hardware.heap import compact_heap

    device_type = "cpu" if profile.kind == "cpu" else "cuda"
    return compact_heap(cfg.train.compact_heap, device_type, activation_checkpointing, cfg.train.tiled_mlp is True,
                        predicted_share=predicted_share)[0]


def allocator_overhead(profile: HardwareProfile, compact: bool = False) -> float:
    """Reserved over allocated memory the run will see: on a GPU, a run with expandable segments (what
    trainforge asks for unless the user's own allocator variable says otherwise) wastes almost nothing to
    fragmentation; the profile's figure is the default allocator's. On a CPU with the compact heap, the
    blocks glibc keeps are the small ones only."""
    from ...hardware.allocator import allocator_settings

    if profile.kind != "gpu":
        if compact:
            from ...hardware.device import CPU_COMPACT_HEAP_OVERHEAD

            return min(profile.allocator_overhead, CPU_COMPACT_HEAP_OVERHEAD)
        return profile.allocator_overhead
    settings = allocator_settings()
    users = str(settings["settings"]).replace(" ", "").lower()
    if settings["set_by"] == "user" and "expandable_segments:true" not in users:
        return profile.allocator_overhead
    return min(profile.allocator_overhead, EXPANDABLE_ALLOCATOR_OVERHEAD)


def planned_kernels(cfg: RunConfig, profile: HardwareProfile) -> str:
    """What ``train.kernels`` becomes on the profile's device: Liger's kernels on a GPU where liger-kernel is
    installed (a plan for another machine assumes it has what this one has), else PyTorch's."""
    from ...model.kernels import liger_installed

    return "liger" if profile.kind == "gpu" and cfg.train.kernels != "torch" and liger_installed() else "torch"


def fixed_bytes(cfg: RunConfig, profile: HardwareProfile, loading: bool = False, compact: bool = False) -> float:
    """What the process holds besides the step's tensors: the profile's fixed cost (``loading``: before
    the first step, where the profile tells them apart), on a CPU plus what a run with adapters holds
    beyond a full fine-tune; with the compact heap (``compact``) the run's extras are what its live data holds,
    without the freed blocks a default heap keeps."""
    if loading and profile.load_fixed_gib is not None:
        fixed = profile.load_fixed_gib * GIB
    elif compact and profile.compact_fixed_gib is not None:
        fixed = profile.compact_fixed_gib * GIB
    else:
        fixed = profile.fixed_gib * GIB
    if profile.kind != "cpu":
        return fixed
    from ...hardware.device import CPU_ADAPTER_EXTRA_GIB, CPU_COMPACT_ADAPTER_EXTRA_GIB, CPU_QLORA_EXTRA_GIB

    if cfg.model.method != "full":
        fixed += (CPU_COMPACT_ADAPTER_EXTRA_GIB if compact and not loading else CPU_ADAPTER_EXTRA_GIB) * GIB
    if cfg.model.method == "qlora":
        fixed += CPU_QLORA_EXTRA_GIB * GIB
    return fixed


@dataclass
class LoadPrediction:
    """Peak resident memory of a CPU process while the weights load, in bytes, and its parts."""

    mapped: int  # weight-file bytes read through the file mapping (pages resident until loading ends)
    converted: int  # the weights those became, in the dtype the run keeps them in, and the adapters
    fixed: int  # the process's fixed cost before its first step
    process: int  # fixed + mapped + converted (with the allocator's overhead)


def predict_load_memory(cfg: RunConfig, precision: Precision, profile: HardwareProfile, memory: MemoryPrediction) -> LoadPrediction | None:
    """Peak resident memory of a CPU process while ``build_model`` loads the weights, from the weight
    files' headers (``model/weight_files.py``); None on a GPU, for ``model.init`` and for weights
    without safetensors headers.

    ``from_pretrained`` maps the safetensors files. A tensor stored in the dtype the run keeps it in
    becomes the parameter as it is, its file pages mapped lazily: loading holds nothing of it (it counts
    among the step's weights once touched). A tensor that is cast (an fp32 checkpoint into a bf16
    frozen base; a bf16 one into fp32 masters) or quantized (QLoRA) is read whole, and its file pages
    stay mapped until loading ends, beside the converted copy. So the load peaks at the fixed cost,
    plus the bytes read from the files, plus the converted weights (QLoRA: the whole base as it is
    stored, NF4 body and the rest in the compute dtype) and the adapters. The mapped pages are clean
    page cache: the kernel can drop them under memory pressure, so a machine with less memory loads
    more slowly rather than failing, but resident memory (peak RSS) counts them.
    """
    if profile.kind != "cpu" or cfg.model.init is not None or cfg.model.path is None:
        return None
    from ...model.load import storage_dtype
    from ...model.weight_files import stored_tensors

    tensors = stored_tensors(cfg.model.path)
    if tensors is None:
        return None
    storage = storage_dtype(cfg.model, precision.autocast_dtype)
    quantized = cfg.model.method == "qlora"
    read = [t for t in tensors if quantized or (t.dtype.is_floating_point and t.dtype != storage)]
    fixed = int(fixed_bytes(cfg, profile, loading=True))
    if not read:
        return LoadPrediction(0, 0, fixed, fixed)
    adapters = memory.trace.trainable_grads if cfg.model.method != "full" and memory.trace is not None else 0
    converted = memory.parts["weights"] if quantized else sum(t.numel for t in read) * storage.itemsize + adapters
    mapped = sum(t.nbytes for t in read)
    return LoadPrediction(mapped, converted, fixed, int(fixed + mapped + converted * (1 + profile.allocator_overhead)))


@dataclass
class Fit:
    """What ``micro_batch_size: auto`` and ``activation_checkpointing: auto`` resolved to, and why."""

    micro_batch_size: int
    activation_checkpointing: bool
    why_micro_batch: str
    why_checkpointing: str
    memory: MemoryPrediction | None  # the prediction at the chosen settings (None: not traced)


def fit_run(
    cfg: RunConfig,
    tokenizer,
    precision: Precision,
    profile: HardwareProfile,
    world_size: int = 1,
    mode: str = "ddp",
    quick: bool = False,
    margin: float = FIT_MARGIN,
) -> Fit:
    """Resolve ``train.micro_batch_size`` and ``train.activation_checkpointing`` when they are ``auto``.

    Checkpointing turns on only when the run does not fit without it (at the configured micro-batch,
    or at one row when the micro-batch is auto too). The auto micro-batch is the largest that fits in
    ``margin`` of the device, from two traces (1 and 2 rows: memory grows linearly in rows) and a
    check of the pick. ``quick``: with a fixed micro-batch, first the rough estimate (memory.py) of the
    model's skeleton; far below the device, nothing is traced.
    """
    t = cfg.train
    auto_mbs, auto_ckpt = t.micro_batch_size == "auto", t.activation_checkpointing == "auto"
    # an auto micro-batch accumulates too: grad_accum as set, or, under global_batch_size, whatever the pick leaves
    # (more than one pass unless it fills the global batch): traced as accumulating, the earlier passes' gradients held
    accum = t.grad_accum if isinstance(t.micro_batch_size, int) or t.global_batch_size is None else 2
    budget = margin * profile.memory_bytes

    def predict(mbs: int, ckpt: bool) -> MemoryPrediction:
        return predict_memory(cfg, tokenizer, precision, profile, mbs, ckpt, accum, world_size, mode)

    if not auto_mbs and not auto_ckpt:
        return Fit(t.micro_batch_size, t.activation_checkpointing, "as configured", "as configured", None)
    if not auto_mbs and quick:
        rough = rough_skeleton_bytes(cfg, tokenizer, precision, t.micro_batch_size)
        if rough < QUICK_SHARE * profile.memory_bytes:
            why = f"off: a rough estimate ({rough / GIB:.2f} GiB) is far below the {profile.memory_bytes / GIB:.1f} GiB of the device"
            return Fit(t.micro_batch_size, False, "as configured", why, None)

    ckpt_options = [False, True] if auto_ckpt else [t.activation_checkpointing]
    if not auto_mbs:
        for ckpt in ckpt_options:
            m = predict(t.micro_batch_size, ckpt)
            if m.fits(margin) or ckpt == ckpt_options[-1]:
                return Fit(t.micro_batch_size, ckpt, "as configured", _why_ckpt(auto_ckpt, ckpt, m, profile), m)

    cap = _auto_cap(cfg, world_size)
    for ckpt in ckpt_options:
        one, two = predict(1, ckpt), predict(2, ckpt)
        if not one.fits(margin) and ckpt != ckpt_options[-1]:
            continue
        m, per_row = _largest_that_fits(lambda rows: predict(rows, ckpt), one, two, budget, margin,
                                        sorted({_allowed(n, cfg, world_size) for n in range(1, cap + 1)}))
        mbs = m.micro_batch_size
        why = (
            f"{mbs}: the largest that fits in {margin:.0%} of {profile.memory_bytes / GIB:.1f} GiB "
            f"(predicted {m.process / GIB:.2f} GiB; {per_row / GIB:.3f} GiB per row)"
            + (f"; capped at {cap}" if mbs == cap else "")
        )
        if not m.fits(margin):
            rows = "one row" if mbs == 1 else f"{mbs} rows (whole groups of rl.num_generations)"
            why = f"{mbs}: even {rows} is predicted at {m.process / GIB:.2f} GiB, over {margin:.0%} of {profile.memory_bytes / GIB:.1f} GiB"
        if m.rollout is not None:
            why += (f"; the rollout samples {m.rollout_rows} completions at once, its KV cache "
                    f"{m.rollout['kv_cache'] / GIB:.2f} GiB")
        return Fit(mbs, ckpt, why, _why_ckpt(auto_ckpt, ckpt, m, profile), m)
    raise AssertionError("unreachable: the last checkpointing option always returns")


def _largest_that_fits(
    predict, one: MemoryPrediction, two: MemoryPrediction, budget: float, margin: float, allowed: list[int],
) -> tuple[MemoryPrediction, int]:
    """(the prediction at the largest of the ``allowed`` micro-batches predicted to fit in ``margin``, the bytes
    per row of the line that found it); the smallest allowed when none fits.

    Memory grows in rows along a line whose slope may steepen past a few rows (the step's peak moves from
    the weights' and optimizer's moments to the activations'), so the line through 1 and 2 rows can be
    optimistic by many rows. The search keeps the largest checked size that fits and the smallest that does
    not, and checks next where the line through those two crosses the budget (an end left unchecked: the
    line through the last two checks); a guess that makes no headway halves the bracket instead."""
    checked = {one.micro_batch_size: one, two.micro_batch_size: two}
    fits = [r for r, m in checked.items() if m.fits(margin)]
    lo = max((i for i, r in enumerate(allowed) if r in fits), default=-1)  # indices into allowed
    hi = min((i for i, r in enumerate(allowed) if r in checked and r not in fits), default=len(allowed))
    line, last, streak = (one, two), "", 0
    guess, per_row = rows_that_fit(*line, budget)
    while lo + 1 < hi:
        i = min(max(sum(r <= guess for r in allowed) - 1, lo + 1), hi - 1)
        if streak >= 2:  # the last two checks moved the same end: bisect, so a curved line cannot crawl
            i = (lo + hi) // 2
        m = checked[allowed[i]] = checked.get(allowed[i]) or predict(allowed[i])
        side = "lo" if m.fits(margin) else "hi"
        streak, last = (streak + 1 if side == last else 1), side
        lo, hi = (i, hi) if side == "lo" else (lo, i)
        if 0 <= lo and hi < len(allowed):
            line = (checked[allowed[lo]], checked[allowed[hi]])
        else:
            line = tuple(sorted(checked.values(), key=lambda p: p.micro_batch_size)[-2:])
        guess, per_row = rows_that_fit(*line, budget)
    pick = allowed[max(lo, 0)]
    return checked.get(pick) or predict(pick), per_row


def rough_skeleton_bytes(cfg: RunConfig, tokenizer, precision: Precision, micro_batch_size: int) -> int:
    """The rough estimate (memory.py) of a step at ``micro_batch_size`` rows, from the model's skeleton (no weights)."""
    from ...model.load import build_model_skeleton

    skeleton = build_model_skeleton(cfg.model, tokenizer, precision.autocast_dtype, False)
    est = estimate_memory(skeleton, micro_batch_size, cfg.row_tokens(), precision)
    parts = {"weights": est.weights, "optimizer": est.optimizer}
    rollout = predict_rollout(cfg, tokenizer, precision, micro_batch_size, cfg.train.grad_accum, 1, parts)
    return max(est.total, sum(rollout[0].values()) if rollout else 0)  # grpo: the rollout's KV cache may be the peak


def rough_skeleton_estimate(
    cfg: RunConfig, tokenizer, precision: Precision, micro_batch_size: int, activation_checkpointing: bool = False,
    shards: int = 1,
) -> MemoryEstimate:
    """The rough estimate (memory.py) of a step at ``micro_batch_size`` rows, from the model's skeleton on the
    meta device: nothing is allocated, whatever the model's size. A QLoRA base counts at 4 bits per weight;
    ``shards``: weights, gradients and optimizer state divided over that many processes (FSDP)."""
    from ...model.load import build_model_skeleton

    skeleton = build_model_skeleton(cfg.model, tokenizer, precision.autocast_dtype, activation_checkpointing)
    if cfg.model.method == "qlora":
        quantize_base_4bit(skeleton, precision.autocast_dtype or torch.float32)
    est = estimate_memory(
        skeleton, micro_batch_size, cfg.row_tokens(), precision, activation_checkpointing, cfg.train.fused_loss
    )
    if shards > 1:
        w, g, o = (-(-x // shards) for x in (est.weights, est.grads, est.optimizer))
        est = MemoryEstimate(w, g, o, est.activations)
    return est


def _why_ckpt(auto: bool, on: bool, m: MemoryPrediction, profile: HardwareProfile) -> str:
    if not auto:
        return "as configured"
    if on:
        return f"on: without it the run does not fit in {profile.memory_bytes / GIB:.1f} GiB"
    return f"off: the run fits without it ({m.process / GIB:.2f} GiB of {profile.memory_bytes / GIB:.1f} GiB)"


def _auto_cap(cfg: RunConfig, world_size: int) -> int:
    g = cfg.train.global_batch_size
    return min(AUTO_MAX_MICRO_BATCH, g // world_size) if g else AUTO_MAX_MICRO_BATCH


def _allowed(mbs: int, cfg: RunConfig, world_size: int) -> int:
    """The largest micro-batch <= ``mbs`` that divides the per-process global batch (when one is set); without one,
    for grpo, the largest multiple of ``micro_batch_unit`` (at least one unit)."""
    g = cfg.train.global_batch_size
    if not g:
        unit = micro_batch_unit(cfg)  # grpo: whole groups of completions per step
        return max(unit, mbs // unit * unit)
    per_process = g // world_size
    return next(d for d in range(max(1, mbs), 0, -1) if per_process % d == 0)
