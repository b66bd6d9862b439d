"""`trainforge plan`: before a run, on any hardware profile, predict its peak memory and speed,
fit it to the device, say what it would decide and what in the config wastes time or will fail.

Nothing is loaded but the config (and a tokenizer directory, for the vocabulary): the step is
traced on fake tensors (engine/predict/), priced on the profile; ``--measure`` runs real ones (tools/plan_measure.py).
"""

from __future__ import annotations

import contextlib
import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config.run import RunConfig, resolve_grad_accum
from ..hardware.cpu_threads import CpuThreads
from ..engine.evaluate import auto_eval_batches, planned_evals
from ..engine.packing_check import settle_packing
from ..engine.predict.fit import FIT_MARGIN, MemoryPrediction, allocator_overhead, fit_run, predict_load_memory, predict_memory
from ..engine.predict.levers import with_decided_levers
from ..engine.predict.memory import estimate_memory
from ..engine.predict.timing import StepTime, measure_ops, predict_step_time
from ..engine.predict.trace_cache import reusing_traces
from ..data.mixture import describe_planned, planned_epochs, planned_mixture
from ..hardware.heap import heap_as
from ..hardware.device import PRECISIONS, Precision, cpu_has_native_bf16, emulated_precision, pick_device, resolve_precision, this_profile
from ..hardware.profiles import GIB, HardwareProfile, find_profile
from .plan_memory import memory_table, rollout_facts
from .plan_moe import no_fit_fix, with_moe
from .plan_decisions import decisions, with_auto_length
from .plan_kernels import attention_share, fp8_problem, fp8_uncompiled, planned_attention
from .plan_optimizer import optimizer_facts, optimizer_levers, with_offload
from .plan_preference import describe_reference, with_reference
from .plan_remedy import one_change_to_fit

SAVE_BYTES_PER_S = 1e9  # assumed checkpoint write speed (local NVMe order); a finding, not a decision, uses it
WASTE_SHARE = 0.05  # checkpoints or evals costing more than this share of the run get a finding


class VocabOnly:
    """The vocabulary size of a tokenizer the run will build from its data (none exists yet)."""

    eos_token_id, pad_token_id, bos_token_id = 0, 1, None

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def plan_tokenizer(cfg: RunConfig):
    """The run's tokenizer where one exists on disk; else a stand-in of the size it will have."""
    from ..model.tokenizer import load_tokenizer

    from ..hf_dir import TOKENIZER_FILES, has_any

    source = cfg.model.tokenizer if cfg.model.tokenizer not in (None, "char") else cfg.model.path
    if cfg.model.tokenizer != "char" and source is not None and has_any(Path(source), TOKENIZER_FILES):
        return load_tokenizer(source)
    if cfg.model.path is not None:  # a config-only directory: the model's own vocabulary
        from ..model.load import architecture_field

        return VocabOnly(architecture_field(cfg.model, "vocab_size") or 0)
    if cfg.model.tokenizer is None:  # a BPE trained on the data: a run before this one cached it
        from ..data.plan import cached_bpe_tokenizer
        from ..data.prepare import resolve_format
        from ..data.sources import DataError

        with contextlib.suppress(DataError, OSError, ValueError):  # the data's own errors are data_facts' to report
            if (tok := cached_bpe_tokenizer(cfg, resolve_format(cfg.data))) is not None:
                return tok
    return VocabOnly(256 if cfg.model.tokenizer == "char" else cfg.model.tokenizer_vocab_size)


def resolve_profile(hardware: str, cfg: RunConfig) -> tuple[HardwareProfile, torch.device | None]:
    """(profile, the local device when planning for this machine)."""
    if hardware.lower() == "this":
        device = pick_device(cfg.train.device)
        return this_profile(device, cfg.data.cache_dir), device
    return find_profile(hardware), None


def plan_precision(cfg: RunConfig, profile: HardwareProfile, device: torch.device | None) -> tuple[Precision, str]:
    """The precision the run would take on this profile, and why."""
    if device is not None:
        return resolve_precision(cfg.train.precision, device, cfg.data.cache_dir)
    requested = cfg.train.precision
    if requested == "auto":
        if profile.bf16:
            return PRECISIONS["bf16"], f"auto: {profile.title} has bf16 tensor cores"
        if profile.peak_tflops["fp16"] < profile.peak_tflops["fp32"]:  # Pascal GeForce: fp16 at 1/64 rate
            return PRECISIONS["fp32"], f"auto: {profile.title} has no bf16 and runs fp16 slower than fp32"
        return PRECISIONS["fp16"], f"auto: {profile.title} has no bf16; fp16 with loss scaling"
    return PRECISIONS[requested], "as configured"


def make_plan(
    cfg: RunConfig, hardware: str = "this", world_size: int = 1, time_ops: bool = True, output: Path | None = None
) -> dict[str, Any]:
    """Everything ``trainforge plan`` reports, as one JSON-able dict."""
    # planning for this machine: its probes and timed ops run on the thread count the run would take now
    # (train.cpu_threads); each process of a data-parallel job gets its share of the cores (torchrun: 1 thread)
    here = hardware.lower() == "this" and world_size == 1
    threads = CpuThreads.for_device(cfg.train.cpu_threads, pick_device(cfg.train.device)) if here else CpuThreads(active=False)
    threads.start()
    try:
        with reusing_traces():  # levers, micro-batch search and advice trace some settings alike: each once
            return _make_plan(cfg, hardware, world_size, time_ops, output)
    finally:
        threads.restore()


def _make_plan(cfg: RunConfig, hardware: str, world_size: int, time_ops: bool, output: Path | None) -> dict[str, Any]:
    profile, device = resolve_profile(hardware, cfg)
    precision, precision_why = plan_precision(cfg, profile, device)
    tokenizer = plan_tokenizer(cfg)
    cfg = settle_packing(cfg, tokenizer, device, lambda _: None)  # as the run settles it: rows one example each or packed
    cfg, length_row = with_auto_length(cfg, tokenizer, precision, profile, world_size)  # data.max_length: auto, as a run
    mode = _distributed_mode(cfg, tokenizer, precision, profile, world_size)
    cfg, lever_why = with_decided_levers(cfg, tokenizer, precision, profile, world_size, mode)  # as a run takes them
    fit = fit_run(cfg, tokenizer, precision, profile, world_size, mode, quick=True)
    mbs, ckpt = fit.micro_batch_size, fit.activation_checkpointing
    resolved = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": mbs, "activation_checkpointing": ckpt})})
    accum = resolve_grad_accum(resolved.train, world_size)
    resolved = resolved.model_copy(update={"train": resolved.train.model_copy(update={"grad_accum": accum})})
    memory = fit.memory or predict_memory(resolved, tokenizer, precision, profile, mbs, ckpt, accum, world_size, mode)
    levers = lever_savings(resolved, tokenizer, precision, profile, memory, accum, world_size, mode)
    load = predict_load_memory(resolved, precision, profile, memory)
    remedy = one_change_to_fit(resolved, tokenizer, precision, profile, memory, accum, world_size, mode)
    threads = 1 if world_size > 1 else None
    measured = {}
    if time_ops and device is not None and device.type == "cpu":
        with heap_as(memory.compact_heap):  # a compact run's ops fault in fresh pages for their outputs: timed so
            measured = measure_ops(memory.trace, threads=threads)
    data = data_facts(cfg, tokenizer)
    step = predict_step_time(memory.trace, profile, accum, measured, attention_share(cfg, precision, device, profile, data))
    step = _with_comms(step, memory, profile, world_size, mode)
    optimizer = optimizer_facts(resolved, memory, profile)
    step = with_offload(step, optimizer)
    step, preference = with_reference(resolved, step, memory)  # a preference run's reference forward
    steps = run_steps(resolved, accum, world_size, data)
    planned_epochs(data, steps, resolved.train.micro_batch_size * accum * world_size, resolved.data.packing is not False, resolved.data.max_length)
    plan: dict[str, Any] = {
        "hardware": {
            "name": profile.name, "title": profile.title, "memory_bytes": profile.memory_bytes,
            "peak_tflops": profile.peak_tflops, "bandwidth_gbs": profile.bandwidth_gbs, "bf16": profile.bf16,
            "source": profile.source, "fixed_bytes": int(profile.fixed_gib * GIB),
            "allocator_overhead": allocator_overhead(profile), **({"measured": profile.measured} if profile.measured else {}),
        },
        "world_size": world_size,
        "memory": {
            "peak_tensor_bytes": memory.tensors,
            "peak_process_bytes": memory.process,
            # what the process adds to its tensors at these settings (on a CPU: less with the compact heap)
            "allocator_overhead": round(memory.scale - 1, 4), "fixed_bytes": int(memory.fixed),
            # CPU: peak RSS while the weights load (file pages read, the weights they became); None: not predicted
            "load_process_bytes": load.process if load else None,
            "load_parts": {"mapped": load.mapped, "converted": load.converted, "fixed": load.fixed} if load else None,
            "capacity_bytes": memory.capacity,
            "share": memory.share,
            "parts": memory.parts,
            "rollout": rollout_facts(resolved, memory),  # grpo: the sampler's phase, its KV cache among its parts
            "fits": memory.fits(),
            "levers": levers,
            "one_change_to_fit": remedy,
        },
        "time": {
            "step_s": step.seconds,
            "tokens_per_step": step.tokens * world_size,
            "tokens_per_s": step.tokens_per_s * world_size,
            "mfu": step.flops / step.seconds / profile.peak_flops(precision.name) if step.seconds else None,
            "compute_s": step.compute_s, "memory_s": step.memory_s, "overhead_s": step.overhead_s,
            "ops_measured": len(measured),
            "steps": steps,
            "run_s": steps * step.seconds if steps else None,
        },
        "optimizer": optimizer,
        "preference": preference,
        "data": data,
        # the heap's row from the prediction at the resolved settings, as the run's set-up decides it (levers.heap_memory)
        "decisions": length_row + decisions(resolved, precision, precision_why, device, replace(fit, memory=memory), accum,
                                            world_size, mode, profile, lever_why),
    }
    plan["findings"] = findings(cfg, resolved, with_moe(plan, resolved, tokenizer, precision, profile), memory, step, profile, device, precision, output)
    return plan


def _distributed_mode(cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, world_size: int) -> str:
    if world_size <= 1:
        return "none"
    if cfg.train.distributed != "auto":
        return cfg.train.distributed
    from ..dist import choose_mode
    from ..model.load import build_model_skeleton

    skeleton = build_model_skeleton(cfg.model, tokenizer, precision.autocast_dtype, False)
    est = estimate_memory(skeleton, 1, cfg.row_tokens(), precision)
    return choose_mode("auto", est.weights + est.grads + est.optimizer, profile.memory_bytes, 1)[0]


def _with_comms(step: StepTime, memory: MemoryPrediction, profile: HardwareProfile, world_size: int, mode: str) -> StepTime:
    """Add the gradient exchange of data parallelism: a ring all-reduce (DDP) or reduce-scatter plus
    all-gather (FSDP) moves about 2 x (n-1)/n of the gradient bytes per process, over NVLink-class
    links on a GPU (assumed 150 GB/s effective) or host memory on a CPU (its bandwidth)."""
    if world_size <= 1:
        return step
    link = 150e9 if profile.kind == "gpu" else profile.bandwidth_gbs * 1e9
    moved = 2 * (world_size - 1) / world_size * memory.trace.trainable_grads * (2 if mode == "fsdp" else 1)
    extra = moved / link
    return StepTime(step.seconds + extra, step.compute_s, step.memory_s + extra, step.overhead_s, step.flops, step.tokens)


LEVER_TITLES = {  # memory.levers keys, as the console says them
    "with_activation_checkpointing": "with activation checkpointing",
    "without_activation_checkpointing": "without activation checkpointing",
    "with_precision_bf16": "with precision bf16 (frozen base stored in bf16)",
    "with_precision_fp16": "with precision fp16 (frozen base stored in fp16)",
    "with_precision_fp32": "with precision fp32 (frozen base stored in fp32)",
    "with_method_qlora": "with method qlora (NF4 base)",
    "with_method_lora": "with method lora (base not quantized)",
    "with_optim_adamw": "with optim.name adamw (fp32 state)",
    "with_optim_adamw_8bit": "with optim.name adamw_8bit (8-bit state, bitsandbytes)",
    "with_optim_adamw_4bit": "with optim.name adamw_4bit (4-bit state, torchao)",
    "with_optim_offload_cpu": "with optim.offload cpu (state in host memory)",
}


def lever_savings(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, memory: MemoryPrediction,
    accum: int, world_size: int, mode: str,
) -> dict[str, int]:
    """Predicted peak tensor bytes with each memory lever flipped from the planned settings (each one
    traced step more): activation checkpointing on every run; under LoRA the frozen base's precision
    (a half-precision run stores it in bf16/fp16, an fp32 run in fp32) and its NF4 quantization
    (LoRA <-> QLoRA). The difference to ``memory.tensors`` is what the lever saves or costs."""
    out = {}
    flipped = not memory.activation_checkpointing
    other = predict_memory(cfg, tokenizer, precision, profile, memory.micro_batch_size, flipped, accum, world_size, mode)
    out["with_activation_checkpointing" if flipped else "without_activation_checkpointing"] = other.tensors
    method = cfg.model.method
    if method == "lora" and precision.name in ("fp32", "bf16", "fp16"):
        half = "bf16" if profile.bf16 or profile.kind == "cpu" else "fp16"  # CPUs store bf16 even where they emulate it
        target = PRECISIONS[half if precision.name == "fp32" else "fp32"]
        other = predict_memory(cfg, tokenizer, target, profile, memory.micro_batch_size, memory.activation_checkpointing,
                               accum, world_size, mode)  # fmt: skip
        out[f"with_precision_{target.name}"] = other.tensors
    if method in ("lora", "qlora"):
        swapped = cfg.model_copy(update={"model": cfg.model.model_copy(update={"method": "qlora" if method == "lora" else "lora"})})
        other = predict_memory(swapped, tokenizer, precision, profile, memory.micro_batch_size, memory.activation_checkpointing,
                               accum, world_size, mode)  # fmt: skip
        out[f"with_method_{swapped.model.method}"] = other.tensors
    out.update(optimizer_levers(cfg, memory, profile))
    return out


def data_facts(cfg: RunConfig, tokenizer) -> dict[str, Any]:
    """Row and token counts of the prepared data (the token cache), when it is prepared."""
    from ..data.cache import STATS_FILE, cache_entry, is_complete
    from ..data.prepare import resolve_format
    from ..data.sources import DataError

    if isinstance(tokenizer, VocabOnly):
        return {"prepared": False, "why": "the tokenizer is built from the data at the start of the run (a first run, or "
                "`trainforge prepare`, caches it and the token counts for the next plan)"}
    try:
        fmt = resolve_format(cfg.data)
        root = cache_entry(cfg.data, fmt, tokenizer, cfg.train.seed, cfg.model.kind.encoder_decoder)  # as prepare_data keys it
    except (DataError, OSError, ValueError) as e:
        return {"prepared": False, "error": str(e)}
    if not is_complete(root):
        return {"prepared": False, "format": fmt, "why": "not in the token cache yet: run `trainforge prepare` for counts"}
    import json

    stats = json.loads((root / STATS_FILE).read_text())
    keep = ("format", "train_rows", "train_sequences", "train_tokens", "train_token_squares", "eval_rows", "eval_sequences", "truncated", "lost_token_share")
    return {"prepared": True, **{k: stats[k] for k in keep if k in stats},
            **planned_mixture(cfg.data, root / "train", cfg.train.seed, cfg.train.objective != "sft", stats.get("source_formats"))}


def run_steps(cfg: RunConfig, accum: int, world_size: int, data: dict[str, Any]) -> int | None:
    """Optimizer steps of the run: max_steps, or epochs over the prepared data."""
    if cfg.train.max_steps:
        return cfg.train.max_steps
    if not data.get("prepared"):
        return None
    epochs = cfg.train.epochs or 1.0
    rows_per_step = cfg.train.micro_batch_size * accum * world_size
    if cfg.data.packing is False:  # a mixture: its epoch's sequences and tokens
        rows = data.get("mixture_sequences", data["train_sequences"])
    else:  # packed or concatenated: rows are about full
        rows = math.ceil(data.get("mixture_tokens", data["train_tokens"]) / cfg.data.max_length)
    return max(1, math.ceil(epochs * rows / rows_per_step))


def findings(
    given: RunConfig, cfg: RunConfig, plan: dict[str, Any], memory: MemoryPrediction, step: StepTime,
    profile: HardwareProfile, device: torch.device | None, precision: Precision, output: Path | None,
) -> list[dict[str, str]]:
    """What a training diagnostic would flag, each with a one-line fix."""
    out: list[dict[str, str]] = []

    def add(level: str, message: str, fix: str) -> None:
        out.append({"level": level, "message": message, "fix": fix})

    mem, cap = memory.process, memory.capacity
    if device is not None and given.train.device.startswith("cuda") and not torch.cuda.is_available():
        add("error", "train.device asks for CUDA, and this machine has none", "set train.device: auto (or cpu), or plan for a GPU with --hardware NAME")
    if not memory.fits():
        remedy = plan["memory"].get("one_change_to_fit")
        auto = given.train.micro_batch_size == "auto" and given.train.activation_checkpointing == "auto"
        smallest = cfg.train.micro_batch_size == 1 and cfg.train.activation_checkpointing is True  # nothing auto could lower
        fix = remedy["text"] if remedy else no_fit_fix(plan.get("moe"), cap) or (
            "no single change fits it: lower data.max_length"
            + (", or a card with more memory" if cfg.model.method == "qlora" else " and use model.method: qlora, or a card with more memory")
            if auto or smallest else "set train.micro_batch_size: auto (and keep train.activation_checkpointing: auto)")
        add("error", f"predicted peak {mem / GIB:.2f} GiB exceeds the {cap / GIB:.1f} GiB of {profile.title}", fix)
    elif memory.share > FIT_MARGIN:
        add("warn", f"predicted peak {mem / GIB:.2f} GiB is {memory.share:.0%} of the {cap / GIB:.1f} GiB: little room for fragmentation",
            "set train.micro_batch_size: auto, or lower it and raise train.grad_accum")
    if precision.name == "bf16" and not profile.bf16 and profile.kind == "gpu":
        add("error", f"train.precision bf16: {profile.title} has no bf16", "set train.precision: auto (fp16 with loss scaling)")
    if fp8_problem(cfg, precision.name, profile):
        add("error", *fp8_problem(cfg, precision.name, profile))
    elif fp8_uncompiled(cfg):
        add("warn", *fp8_uncompiled(cfg))
    # another machine's CPU profile: whether its bf16 is native is unknown, so only fp16 is said
    emulated = emulated_precision(precision.name, device is None or cpu_has_native_bf16()) if profile.kind == "cpu" else None
    if emulated:
        add("warn", *emulated)
    from ..model.load import position_problem

    positions = position_problem(cfg.model, cfg.data.max_length)
    if positions:
        add(*positions)
    data, steps = plan["data"], plan["time"]["steps"]
    if data.get("prepared") and steps:
        tokens_per_step = plan["time"]["tokens_per_step"]
        epochs = steps * tokens_per_step / max(data["train_tokens"], 1)
        if epochs > 10:
            add("warn", f"{steps} steps of {tokens_per_step:,} tokens are {epochs:.0f} passes over {data['train_tokens']:,} training tokens: the model will memorize them",
                "lower train.max_steps, or set train.epochs: 1-3")
    elif not data.get("prepared"):
        add("info", "data not prepared yet: the run's duration needs its token count" if not steps else "data not prepared yet: token counts unknown",
            "run `trainforge prepare CONFIG` (the run reuses its cache)")
    # checkpoints: disk needed and time spent
    trainable = memory.trace.trainable_grads if memory.trace else 0
    ckpt_bytes = 3 * trainable  # trained weights (LoRA: adapters only) and their two Adam moments, fp32
    need = (cfg.checkpoint.keep_last + 1) * ckpt_bytes  # +1: the next one is written before the oldest goes
    free = _free_disk(output or Path("runs"))
    if free is not None and need > free:
        add("error", f"keep_last {cfg.checkpoint.keep_last} checkpoints of {ckpt_bytes / GIB:.2f} GiB need {need / GIB:.1f} GiB; {free / GIB:.1f} GiB free",
            "lower checkpoint.keep_last, or write the run to a larger disk (--output)")
    if cfg.checkpoint.every_steps and steps and step.seconds:
        save_s = ckpt_bytes / SAVE_BYTES_PER_S
        share = save_s / (cfg.checkpoint.every_steps * step.seconds + save_s)
        if share > WASTE_SHARE and not cfg.checkpoint.async_:
            better = math.ceil(save_s / (WASTE_SHARE * step.seconds) / 10) * 10
            add("warn", f"checkpoint.every_steps {cfg.checkpoint.every_steps}: saving (~{save_s:.1f}s each) takes {share:.0%} of the run",
                f"set checkpoint.every_steps: {better} or more, or checkpoint.async: true")
    eval_every = cfg.train.eval_every if cfg.train.eval_every != "auto" else (max(1, steps // 10) if steps else None)
    if eval_every and step.seconds:
        batches = eval_batches_per_pass(cfg, data, steps, plan["world_size"])
        eval_s = batches * step.seconds / cfg.train.grad_accum / 3  # a forward pass only: about a third of a micro-batch's time
        share = eval_s / (eval_every * step.seconds + eval_s)
        if share > 2 * WASTE_SHARE:
            add("warn", f"train.eval_every {cfg.train.eval_every}: evaluation takes about {share:.0%} of the run",
                "raise train.eval_every or lower train.eval_max_batches")
    if warmup := cfg.optim.warmup_problem(steps):
        add("warn", *warmup)
    if given.log.every_steps == 1:
        add("info", "log.every_steps 1 reads the loss from the device every step (a host sync)", "set log.every_steps: 10")
    if cfg.train.micro_batch_size == 1 and cfg.train.grad_accum > 1 and given.train.micro_batch_size != "auto":
        add("warn", "micro-batch 1 with accumulation: each pass is too small to use the device well",
            "set train.micro_batch_size: auto with train.global_batch_size to keep the global batch")
    return out


def eval_batches_per_pass(cfg: RunConfig, data: dict[str, Any], steps: int | None = None, world_size: int = 1) -> int:
    """Micro-batches of one evaluation: ``train.eval_max_batches``; for ``auto`` as the run chooses them from
    its ``steps`` (engine/evaluate.py); else (null, or auto with the length unknown) the eval rows (50 when the
    data is not prepared yet) over the micro-batch."""
    rows = data.get("eval_sequences") or data.get("eval_rows") or 50
    t = cfg.train
    available = math.ceil(rows / t.micro_batch_size)
    if isinstance(t.eval_max_batches, int):
        return t.eval_max_batches
    if t.eval_max_batches == "auto" and steps:
        evals = planned_evals(steps, t.eval_every if isinstance(t.eval_every, int) else max(1, steps // 10) if t.eval_every else None)
        rows_trained = steps * t.micro_batch_size * resolve_grad_accum(t, world_size) * world_size
        return auto_eval_batches(available, t.micro_batch_size, rows_trained, evals, cfg.model.method, t.activation_checkpointing is True, world_size)
    return available


def _free_disk(path: Path) -> int | None:
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def render(plan: dict[str, Any], console) -> None:
    """The plan for people: memory split, speed and duration, decisions, findings."""
    from rich.markup import escape
    from rich.table import Table

    h, m, t = plan["hardware"], plan["memory"], plan["time"]
    world = f", {plan['world_size']} processes" if plan["world_size"] > 1 else ""
    console.print(f"[bold]plan[/bold] for {h['title']}{world} ({h['source']})")
    console.print(memory_table(m, h))
    verdict = "[green]fits[/green]" if m["fits"] else "[red]does not fit[/red]"
    console.print(f"{verdict}: {m['share']:.0%} of {m['capacity_bytes'] / GIB:.1f} GiB")
    for lever, value in m["levers"].items():
        console.print(f"  {LEVER_TITLES.get(lever, lever.replace('_', ' '))}: tensors {value / GIB:.3f} GiB "
                      f"({(value - m['peak_tensor_bytes']) / GIB:+.3f})")
    mfu = f", MFU {t['mfu']:.0%}" if t.get("mfu") else ""
    how = f"; {t['ops_measured']} distinct ops timed on this machine" if t["ops_measured"] else ""
    console.print(
        f"speed: {t['step_s']:.3f} s per step, {t['tokens_per_s']:,.0f} tokens/s{mfu} "
        f"(compute {t['compute_s']:.3f}s, memory-bound {t['memory_s']:.3f}s, per-op overhead {t['overhead_s']:.3f}s{how})"
    )
    o = plan["optimizer"]
    line = f"optimizer: {o['describe']}, state {o['device_bytes'] / GIB:.3f} GiB on the device"
    if o["offload"] == "cpu":
        line += (f", {o['host_bytes'] / GIB:.3f} GiB in host memory; per step {o['pcie_s']:.3f}s over PCIe "
                 f"and {o['host_step_s']:.3f}s of host AdamW (included above)")
    console.print(line + ("; paged: spills to host memory under pressure instead of running out" if o["paged"] else ""))
    if plan.get("preference"):
        console.print(describe_reference(plan["preference"]))
    if t["run_s"]:
        console.print(f"run: {t['steps']:,} steps, about {_duration(t['run_s'])}")
    d = plan["data"]
    if d.get("prepared"):
        console.print(f"data: {d['format']}, {d['train_rows']:,} rows, {d['train_tokens']:,} training tokens")
        for line in describe_planned(d):
            console.print(line, markup=False, highlight=False)
    decisions_table = Table(title="decisions", title_justify="left")
    for col in ("setting", "choice", "why"):
        decisions_table.add_column(col)
    for row in plan["decisions"]:
        decisions_table.add_row(*(escape(row[k]) for k in ("setting", "choice", "why")))  # "[gpu]" is not markup
    console.print(decisions_table)
    colors = {"error": "red", "warn": "yellow", "info": "cyan"}
    for f in plan["findings"]:
        console.print(f"[{colors[f['level']]}]{f['level']}[/]: {f['message']}\n  fix: {f['fix']}", highlight=False)
    if not plan["findings"]:
        console.print("no findings")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render_profiles(console) -> None:
    """One line per profile: --hardware name, device, memory, peak TFLOP/s per precision, bandwidth, source."""
    from ..hardware.profiles import describe_profiles

    console.print("hardware profiles (--hardware NAME; 'this' measures the local machine); dense TFLOP/s:")
    for p in describe_profiles():
        console.print(
            f"  {p['name']:<10} {p['title']:<30} {p['memory_gib']:>4g} GiB  bf16 {p['bf16_tflops'] or '-':>6}  "
            f"fp16 {p['fp16_tflops']:>6}  tf32 {p['tf32_tflops'] or '-':>5}  fp32 {p['fp32_tflops']:>5}  "
            f"{p['bandwidth_gbs']:>5g} GB/s  ({p['source']})",
            highlight=False, markup=False,
        )
