"""Setting up a run: everything before the first step (device and precision, data, model, optimizer, schedule, resume)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..hardware.allocator import prefer_expandable_segments
from ..config.run import RunConfig, resolve_grad_accum, resolve_max_steps
from ..config.data import default_cache_dir
from ..hardware.cpu_threads import CpuThreads
from ..data.examples import row_describer
from ..data.loader import eval_batches
from ..data.plan import check_objective_data, describe_data, get_tokenizer, note_run_epochs
from ..dist import DistContext, device_for
from ..hardware.device import (
    PRECISIONS, Precision, available_memory_bytes, configure_backends, cpu_has_native_bf16, cpu_matmul_flops,
    cpu_peak_precision, describe, device_memory, emulated_precision, peak_flops, pick_device, resolve_precision, this_profile,
)
from ..metrics.console import ConsoleReporter
from ..metrics.flops import flops_per_token
from ..metrics.profile import StepTimer
from ..metrics.sinks import build_sinks, require_trackers
from ..metrics.thresholds import limit
from ..metrics.tracker import MetricsLog, NullMetricsLog
from ..metrics.window import LogWindow
from ..model.experts_impl import describe as describe_experts
from ..model.fp8 import resolve_fp8
from ..model.kernels import resolve_kernels
from ..model.load import build_model, count_parameters, describe_storage, overflows_in_fp16, weight_storage
from ..rundir.writing import writing
from ..rl.wiring import bind_rollouts, data_planner, loader_type
from .advisor import Advisor
from .compile_auto import HISTORY_FILE, CompileAuto, compile_key
from .ending import eval_stopped_at_checkpoint
from .levers import apply_levers, heap_memory, resolve_run_levers, settle_heap
from .loss import kernels_for_head, loss_head_fact
from .evaluate import auto_eval_batches, planned_evals
from .predict.fit import Fit, fit_run
from .predict.trace_cache import reusing_traces
from .predict.memory import estimate_memory, memory_warning
from .nonfinite import NonFiniteGuard
from .objective import build_objective, describe_objective
from .packing_check import settle_packing
from .reference import attach_reference
from .optim import build_optimizer, check_optimizer, describe_optimizer
from ..stop import StopRequest
from .resume import (
    CHECKPOINTS, ResumePlan, bound_grad_accum, check_fits_run, checkpoint_meta, choose_checkpoint, resume_note,
    resumes_a_checkpoint, wrote_its_end,
)
from .ranks import batch_layout, wrap_for_ranks
from .row_length import fit_length
from .run import Run, RunFacts
from .saver import Checkpointer
from .schedule import build_scheduler
from .sharded import checkpoint_writer
from .state import Counters


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(
    cfg: RunConfig,
    output_dir: Path,
    reporter: ConsoleReporter,
    resume: str = "auto",
    stop: StopRequest | None = None,
    ctx: DistContext | None = None,
) -> Run:
    """Everything before the first step, in phases: device and precision; data, tokenizer and the run
    directory; the model fitted to this machine; optimizer and services; the checkpoint to resume."""
    from transformers.utils import logging as hf_logging

    started_at = time.perf_counter()
    laps = Laps(started_at)
    ctx, stop = ctx or DistContext(), stop or StopRequest()
    if cfg.log.report_to:
        require_trackers(cfg.log.report_to)  # a tracker asked for but not installed fails before any work
    if cfg.train.micro_batch_size != "auto":  # a contradiction fails before any work (auto resolves below)
        # a checkpoint's micro-batch (maybe an out-of-memory back-off's) decides whether it divides: resumed_grad_accum
        (bound_grad_accum if resumes_a_checkpoint(Path(output_dir), resume) else resolve_grad_accum)(cfg.train, ctx.world_size)
    hf_logging.disable_progress_bar()  # weight-loading and shard bars are noise next to our own log
    seed_everything(cfg.train.seed)
    device, precision, why, cpu_threads = choose_device_and_precision(cfg, ctx, reporter)
    # a missing library or an optimizer this device cannot run fails before any work (the mode is checked below)
    check_optimizer(cfg.optim, device.type, None)
    laps("device")

    with ctx.main_first():  # rank 0 builds the tokenizer (a BPE trained on the data: cached); the others load it
        check_objective_data(cfg)  # data of the wrong kind fails before a tokenizer is trained on it
        tokenizer = get_tokenizer(cfg, reporter)
    # packed documents kept apart by the attention the run will use, measured before any row is packed
    cfg = settle_packing(cfg, tokenizer, device, reporter.info)
    laps("tokenizer")
    # data.max_length auto resolved; a row past a learned position table (exit 2) or a run that cannot fit (exit 4)
    # refused before the data and the model cost anything (row_length.py; rank 0 decides)
    cfg, length_facts = fit_length(cfg, tokenizer, precision, device, ctx, Path(output_dir), resume, reporter)
    laps("fit_check")
    with ctx.main_first():  # rank 0 tokenizes into the cache and checks the run directory; the others reuse both
        # a signal stops tokenizing at the next chunk; bad data fails before the run dir exists
        data = data_planner(cfg)(cfg, tokenizer, reporter, device.type == "cuda", lambda: stop.stop_before_training(output_dir, ctx.enabled))
        out = Path(output_dir)
        resume_plan = choose_checkpoint(out, cfg, resume, reporter, ctx.world_size, ctx.is_main)
        if resume_plan is None and ctx.is_main:
            with writing(out / "config.yaml"):
                (out / "config.yaml").write_text(cfg.anchored().to_yaml())  # a resumed run's, once the checkpoint is checked
    laps("data")
    stop.stop_before_training(out, ctx.enabled)  # a signal while tokenizing: no model, eval nor checkpoint
    reporter.info(f"output: {out}")
    with reusing_traces():  # the levers and the micro-batch search trace some settings alike: each once
        cfg, levers_memory = resolve_run_levers(cfg, tokenizer, precision, device, ctx, reporter.info)  # tiled MLP, offload
        cfg, fit = fit_to_machine(cfg, tokenizer, precision, device, ctx, reporter, resume_plan)
        # a CPU run short of memory gives freed blocks back: decided from the prediction at the run's settings, as plan
        memory = heap_memory(cfg, tokenizer, precision, device, ctx, fit.memory, levers_memory)
    heap = settle_heap(cfg, device, reporter.info, memory)
    laps("fit")
    cfg, micro, accum = batch_layout(cfg, ctx.world_size, resume_plan)
    loader = loader_type(cfg)(
        data.train_rows, data.collate, micro, cfg.train.seed, cfg.data.packing is False, rank=ctx.rank, world_size=ctx.world_size,
    )
    efficiency = loader.padding_efficiency()
    reporter.info(describe_data(data, efficiency))
    data_stats = {**data.prepared.stats, "rows": len(data.train_rows), "row_efficiency": efficiency}

    model = build_run_model(cfg, tokenizer, precision, device, reporter)
    objective = build_objective(cfg, model)  # before any checkpoint loads: a frozen reference is the starting weights
    bind_rollouts(cfg, loader, model, objective, tokenizer, precision, device, accum)  # grpo: the policy samples
    if objective.unit == "pair":
        reporter.info(describe_objective(objective, data.prepared.train.desirable))
    if objective.reference == "precompute":  # the starting weights' log-probabilities, once, from the cache after that
        attach_reference(cfg, data, model, precision, device, ctx, reporter.info)
    laps("model")
    stop.stop_before_training(out, ctx.enabled)
    rough = estimate_memory(model, loader.batch_size, cfg.row_tokens(), precision)
    warning = memory_warning(rough, available_memory_bytes(device), device)
    if warning:
        reporter.warn(warning)
    train_model = wrap_for_ranks(ctx, cfg, model, loader, accum, rough, device, reporter)
    check_optimizer(cfg.optim, device.type, ctx.mode if ctx.mode != "none" else None)
    optimizer = build_optimizer(model, cfg.optim, device)
    if cfg.optim.name != "adamw" or cfg.optim.offload != "none":
        reporter.info(f"optimizer: {describe_optimizer(cfg.optim)}")
    max_steps = resolve_max_steps(cfg.train.model_copy(update={"grad_accum": accum}), loader.batches_per_epoch)
    note_run_epochs(data_stats, len(data.train_rows), max_steps * micro * accum * ctx.world_size, reporter)
    if warmup := cfg.optim.warmup_problem(max_steps):  # the lr would never reach its value
        reporter.warn("; ".join(warmup))
    if cfg.train.eval_every == "auto":  # ten evaluations over the run
        every = max(1, max_steps // 10)
        reporter.info(f"eval_every auto -> {every} (ten evaluations over {max_steps} steps)")
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": every})})
    # a resumed run keeps its schedule's horizon (resume.py's docstring says why)
    schedule_steps = resume_plan.state["counters"]["schedule_steps"] if resume_plan is not None else max_steps
    o = cfg.optim
    metrics = open_metrics(cfg, out, resume_plan, reporter) if ctx.is_main else NullMetricsLog()
    saver = Checkpointer(
        out / CHECKPOINTS,
        cfg.checkpoint.model_copy(update={"async_": False}) if ctx.mode == "fsdp" else cfg.checkpoint,
        checkpoint_meta(cfg, tokenizer, {**data_stats, "store": data.prepared.cache_path.name}, ctx.world_size, ctx.mode),
        reporter,
        writer=checkpoint_writer(ctx),
    )
    saver.on_event = metrics.event  # checkpoints and the pauses they cost, to events.jsonl
    describe = row_describer(data.prepared.train, data.train_rows, [s.path for s in cfg.data.sources()], tokenizer)
    run = Run(
        cfg=cfg,
        out=out,
        max_steps=max_steps,
        device=device,
        precision=precision,
        tokenizer=tokenizer,
        model=model,
        train_model=train_model,
        params=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, o.schedule, o.warmup_steps, schedule_steps, o.min_lr_ratio),
        scaler=torch.amp.GradScaler(device.type) if precision.needs_grad_scaler else None,
        loader=loader,
        eval_set=build_eval_set(cfg, data, max_steps, ctx.world_size, reporter),
        grad_accum=accum,
        cpu_threads=cpu_threads,
        compile_auto=CompileAuto(
            cfg.train.compile, compile_key(compile_shape(cfg, model, precision, device, ctx)),
            (cfg.data.cache_dir or default_cache_dir()) / HISTORY_FILE, device,
        ),
        reporter=reporter,
        metrics=metrics,
        saver=saver,
        guard=NonFiniteGuard(cfg.train.max_skipped_steps, device, newest_checkpoint=saver.newest_complete, describe=describe),
        window=LogWindow.on(device),
        stop=stop,
        dist=ctx,
        sync=ctx.no_sync(train_model),
        facts=run_facts(cfg, model, precision, device, ctx, why, data.prepared.format, data_stats, fit, reporter, objective),
        timer=StepTimer(device),
        counters=Counters(schedule_steps=schedule_steps),
        started_at=started_at,
        objective=objective,
        advisor=Advisor(
            device_memory(device)[0], peak_reprobe(device, precision, cfg.data.cache_dir, ctx.world_size),
            judge_mfu=not (device.type == "cpu" and emulated_precision(precision.name, cpu_has_native_bf16())), describe=describe,
            judge_loss=cfg.train.objective != "grpo",
        ),
    )
    run.facts.choices.update(length_facts | heap)  # what data.max_length is and why (auto: what it chose); the heap
    run.facts.choices["loss_head"] = loss_head_fact(
        train_model, cfg.train.fused_loss, cfg.model.kind.encoder_decoder, reporter.info, reporter.warn)
    run.facts.choices["kernels"] = kernels_for_head(run.facts.choices["kernels"], run.facts.choices["loss_head"])
    laps("services")
    # a signal is in events.jsonl when it comes: a second one (or a SIGKILL) that ends the process before its stop
    # event is written leaves doctor that much
    stop.on_signal = lambda name: run.metrics.event("signal", run.step, signal=name)
    if resume_plan is not None:
        continue_from(run, resume_plan)  # last: it restores the random states that building the run consumed
        laps("resume")
    run.startup_phases = laps.seconds
    return run


class Laps:
    """Seconds between named points of set-up, for the start-up accounting (summary.json ``time.startup``).
    The first set-up of a process also counts the imports since ``trainforge`` was imported."""

    first = True

    def __init__(self, start: float):
        from .. import IMPORTED_AT

        self.seconds: dict[str, float] = {"imports": round(start - IMPORTED_AT, 3)} if Laps.first else {}
        Laps.first, self.last = False, start

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.last, 3)
        self.last = now


def peak_reprobe(device: torch.device, precision: Precision, cache_dir: Path | None, world_size: int):
    """For the advisor: on a CPU, measure the matmul peak again (replacing the cached probe) and return
    (the run's peak FLOP/s, where from); None on a GPU, whose peak comes from its profile."""
    if device.type != "cpu":
        return None
    probed, where = cpu_peak_precision(precision.name)
    return lambda: (cpu_matmul_flops(probed, cache_dir, again=True) * world_size, f"{where}, measured again")


def build_eval_set(cfg: RunConfig, data: Any, max_steps: int, world_size: int, reporter: ConsoleReporter) -> list:
    """The eval batches of every evaluation of the run; ``train.eval_max_batches: auto`` sizes them to the run
    (evaluate.py's ``auto_eval_batches``) and says what it chose."""
    if not data.eval_collate:
        return []
    t = cfg.train
    available = -(-len(data.eval_rows) // t.micro_batch_size)
    if t.eval_max_batches != "auto":
        return eval_batches(data.eval_rows, data.eval_collate, t.micro_batch_size, t.eval_max_batches)
    evals = planned_evals(max_steps, t.eval_every if isinstance(t.eval_every, int) else None)
    train_rows = max_steps * t.micro_batch_size * t.grad_accum * world_size
    n = auto_eval_batches(available, t.micro_batch_size, train_rows, evals, cfg.model.method, t.activation_checkpointing is True, world_size)
    share = f"{limit('eval_share'):.0%}"
    if n < available:
        reporter.info(f"eval: {n} of {available} batches per evaluation, {evals} evaluations (train.eval_max_batches "
                      f"auto: within {share} of the training compute; set a number, or null for all)")
    else:
        reporter.info(f"eval: all {n} batch{'es' if n > 1 else ''} per evaluation, {evals} evaluations (within {share} of the training compute)")
    return eval_batches(data.eval_rows, data.eval_collate, t.micro_batch_size, n)


def choose_device_and_precision(
    cfg: RunConfig, ctx: DistContext, reporter: ConsoleReporter
) -> tuple[torch.device, Precision, str, CpuThreads]:
    """This process's device, the run's precision and why, its CPU threads; backends configured for them, and said."""
    prefer_expandable_segments()  # a run started from Python, not the CLI: still before CUDA's allocator starts
    device = device_for(pick_device(cfg.train.device), ctx)
    threads = CpuThreads.for_device(cfg.train.cpu_threads, device)
    thread_note = threads.start()  # before the precision's matmul probe, which is kept per thread count
    precision, why = resolve_precision(cfg.train.precision, device, cfg.data.cache_dir)
    precision, why = fp16_safe_precision(cfg, precision, why, reporter)
    configure_backends(device)
    procs = f" | {ctx.world_size} processes" if ctx.enabled else ""
    reporter.info(f"trainforge {__version__} | {describe(device)}{procs} | precision {precision.name} ({why})")
    if thread_note:
        reporter.info(thread_note)
    emulated = emulated_precision(precision.name, cpu_has_native_bf16()) if device.type == "cpu" else None
    if emulated:
        reporter.warn("; ".join(emulated))
    return device, precision, why, threads


def build_run_model(
    cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, reporter: ConsoleReporter
) -> torch.nn.Module:
    """The model of ``model`` (pretrained, or from its config) with its method applied, on ``device``, in train mode."""
    kernels = resolve_kernels(cfg.train.kernels, device.type)
    fp8 = resolve_fp8(cfg.train.fp8, device, precision.autocast_dtype, cfg.model.method)
    if fp8 and device.type == "cpu":
        reporter.warn("train.fp8 on a CPU: torch emulates the FP8 matmuls, slower than bf16 (for checking a config before a GPU run)")
    if fp8 and cfg.train.compile is False:
        reporter.warn("train.fp8 uncompiled: torchao's scales and casts run as separate kernels" + (
            ", and under LoRA it also computes the frozen base layers' weight gradients (one more FP8 matmul per layer, "
            "then discarded)" if cfg.model.method == "lora" else "") + "; compiled, they fuse: set train.compile: true or auto")
    model = apply_levers(build_model(
        cfg.model, tokenizer, cfg.train.seed, device, precision.autocast_dtype is not None,
        compute_dtype=precision.autocast_dtype, activation_checkpointing=cfg.train.activation_checkpointing,
        kernels=kernels, fp8=fp8, warn=reporter.warn,
    ).to(device), cfg, device, reporter.info)  # tiled MLP, activation offload (engine/levers.py)
    model.train()
    trainable, total = count_parameters(model)
    used = getattr(model, "trainforge_kernels", [])
    reporter.info(
        f"model: {cfg.model.method}, {total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable, "
        f"attention {model.config._attn_implementation}, kernels {'liger (' + ', '.join(used) + ')' if used else 'torch'}"
        + (f", fp8 {model.trainforge_fp8}" if getattr(model, "trainforge_fp8", None) else "")
        + (f", {model.trainforge_lora_fused} fused LoRA layers" if getattr(model, "trainforge_lora_fused", None) else "")
        + describe_experts(model) + (", activation checkpointing" if cfg.train.activation_checkpointing else "")
    )
    reporter.info(f"weights: {describe_storage(weight_storage(model))}")
    left_out = getattr(model, "trainforge_lora_left_out", None)
    if left_out:
        reporter.warn(f"LoRA all-linear leaves out {len(left_out)} layers ({', '.join(sorted({n.rsplit('.', 1)[-1] for n in left_out}))}): "
                      "PEFT's load would put their saved adapters on other names (this model type's checkpoint renamings)")
    return model


def run_facts(
    cfg: RunConfig, model: torch.nn.Module, precision: Precision, device: torch.device, ctx: DistContext, why: str,
    data_format: str, data_stats: dict[str, Any], fit: Fit, reporter: ConsoleReporter, objective: Any = None,
) -> RunFacts:
    """FLOPs per token and the device peak (for MFU), with what setup chose and why; the compute line is said."""
    # encoder-decoder: a source token costs the encoder's matmuls, a target token the decoder's and the head's
    share = data_stats["train_target_tokens"] / max(data_stats["train_tokens"], 1) if data_stats.get("encoder_decoder") else None
    per_token = flops_per_token(model, cfg.data.max_length, share)
    if objective is not None and objective.unit == "pair" and objective.reference in ("model", "adapters"):
        # the reference's forward is a third of a trained token's forward + backward; KTO adds a policy forward too
        per_token *= 5 / 3 if objective.name == "kto" else 4 / 3
    device_peak, source = peak_flops(device, precision.name, cfg.data.cache_dir)
    peak = device_peak * ctx.world_size  # tokens/s is the global figure: so is the peak
    reporter.info(
        f"compute: {per_token / 1e6:.1f} MFLOP per token; device peak "
        + (f"{peak / 1e12:.2f} TFLOP/s ({source})" if peak else source)
    )
    choices = fit_summary(fit) | {
        "attention": getattr(model.config, "_attn_implementation", None),
        "kernels": getattr(model, "trainforge_kernels", []) or "torch",
        "fp8": getattr(model, "trainforge_fp8", None),
        "lora_fused_layers": getattr(model, "trainforge_lora_fused", None),
        "lora_expert_weights_factored": getattr(model, "trainforge_lora_experts", None) or None,  # lora_experts.py
        "experts_implementation": (getattr(model, "trainforge_experts", None) or (None,))[0],
        # the load-balancing loss's coefficient the run trains with (the model config's, or model.router_aux_loss's)
        "router_aux_loss_coef": getattr(getattr(objective, "router", None), "coef", None),
    }
    return RunFacts(why, data_format, data_stats, per_token, peak, choices)


def continue_from(run: Run, plan: ResumePlan) -> None:
    """Load the chosen checkpoint into the freshly built run, once it is checked to continue it."""
    check_fits_run(plan, run)
    run.load_state_dict(plan.state, plan.checkpoint.path)
    if plan.same_run:
        saved = plan.state["counters"].get("metrics_records")  # a finished run's final eval is not redone: kept
        later, unreadable = run.metrics.keep_through(plan.checkpoint.step, saved, wrote_its_end(run.out))
        if later:
            run.reporter.info(f"metrics.jsonl: dropped {later} records written after {plan.checkpoint.path.name}")
        if unreadable:
            run.reporter.warn(f"metrics.jsonl: dropped {unreadable} lines that are not metrics records (torn or foreign)")
        run.eval_again = eval_stopped_at_checkpoint(run)
    if run.dist.is_main:
        with writing(run.out / "config.yaml"):
            (run.out / "config.yaml").write_text(run.cfg.anchored().to_yaml())
    run.reporter.info(resume_note(plan, run))
    run.metrics.event("resume", run.step, checkpoint=plan.checkpoint.path.name,  # and the processes before and now
                      processes=run.dist.world_size, checkpoint_processes=plan.checkpoint.meta.get("world_size", 1))


def fp16_safe_precision(cfg: RunConfig, precision: Precision, why: str, reporter: ConsoleReporter) -> tuple[Precision, str]:
    """T5-family models (T5, mT5, Flan-T5, ...) overflow in fp16: pretrained in bf16, their feed-forward
    activations exceed fp16's largest value (65504). ``precision: auto`` takes fp32 instead of fp16
    for them (fp16 is its choice only on GPUs without bf16) and says so; an explicit fp16 is warned."""
    family = overflows_in_fp16(cfg.model)
    if precision.name != "fp16" or family is None:
        return precision, why
    if cfg.train.precision == "auto":
        return PRECISIONS["fp32"], f"{why}; but {family} models overflow in fp16, so fp32"
    reporter.warn(
        f"train.precision=fp16: {family} models are known to overflow in fp16 (activations past 65504); steps with "
        "a non-finite loss or gradient are skipped and the run stops after train.max_skipped_steps in a row. "
        "Use bf16 where the hardware has it, else fp32"
    )
    return precision, why


def open_metrics(cfg: RunConfig, out: Path, resume_plan: ResumePlan | None, reporter: ConsoleReporter) -> MetricsLog:
    """metrics.jsonl and the trackers of ``log.report_to``; a resume of this run directory continues
    the tracker runs (W&B id, MLflow run id) its checkpoint names."""
    same_run = resume_plan is not None and resume_plan.same_run
    resume = resume_plan.state["counters"].get("trackers", {}) if same_run else {}
    sinks = build_sinks(
        cfg.log.trackers(), cfg.log.report_to is not None, out, out.resolve().name, cfg.log.project,
        cfg.model_dump(mode="json"), resume,
    )
    for sink in sinks:
        if sink.name != "tensorboard":
            reporter.info(f"{sink.name}: {sink.where}")
    return MetricsLog(out / "metrics.jsonl", sinks, writing)  # a full disk: RunDirWriteError naming the file


def fit_to_machine(
    cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, ctx: DistContext, reporter: ConsoleReporter,
    resume_plan: Any = None,
) -> tuple[RunConfig, Fit]:
    """Resolve ``micro_batch_size``/``activation_checkpointing: auto`` from the plan of this run here (rank 0 decides
    for all); a resumed run keeps its checkpoint's micro-batch (the global batch must not change mid-run)."""
    t = cfg.train
    saved = resume_plan.checkpoint.meta.get("fixed", {}).get("train.micro_batch_size") if resume_plan is not None else None
    if t.micro_batch_size == "auto" and isinstance(saved, int):
        t = t.model_copy(update={"micro_batch_size": saved})
        cfg = cfg.model_copy(update={"train": t})
        reporter.info(f"micro_batch_size auto -> {saved}: as in the checkpoint being resumed")
    if t.micro_batch_size != "auto" and t.activation_checkpointing != "auto":
        return cfg, Fit(t.micro_batch_size, t.activation_checkpointing, "as configured", "as configured", None)
    fit = None
    if ctx.is_main:
        profile = this_profile(device, cfg.data.cache_dir, timing=False)
        mode = "fsdp" if t.distributed == "fsdp" else "ddp"
        fit = fit_run(cfg, tokenizer, precision, profile, ctx.world_size, mode, quick=True)
        if fit.memory is not None:
            fit.memory.trace = None  # its ops are the plan's business; the run keeps the figures
    fit = ctx.broadcast_object(fit)
    if t.micro_batch_size == "auto":
        reporter.info(f"micro_batch_size auto -> {fit.why_micro_batch}")
    if t.activation_checkpointing == "auto":
        reporter.info(f"activation checkpointing auto -> {fit.why_checkpointing}")
    update = {"micro_batch_size": fit.micro_batch_size, "activation_checkpointing": fit.activation_checkpointing}
    return cfg.model_copy(update={"train": t.model_copy(update=update)}), fit


def fit_summary(fit: Fit) -> dict[str, Any]:
    """What the run chose for itself and why, for summary.json."""
    out: dict[str, Any] = {
        "micro_batch_size_reason": fit.why_micro_batch,
        "activation_checkpointing_reason": fit.why_checkpointing,
    }
    if fit.memory is not None:
        out["predicted_peak_memory_bytes"] = fit.memory.process
        out["predicted_peak_tensor_bytes"] = fit.memory.tensors
    return out


def compile_shape(cfg: RunConfig, model: torch.nn.Module, precision: Precision, device: torch.device, ctx: DistContext) -> dict:
    """What decides the compiled graphs and their speed: the key of ``compile_history.json``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "model": base.config.to_dict(),
        "method": cfg.model.method,
        "lora": cfg.model.lora.model_dump() if cfg.model.method != "full" else None,
        "batch": [cfg.train.micro_batch_size, cfg.data.max_length, str(cfg.data.packing)],
        "precision": precision.name,
        "fused_loss": cfg.train.fused_loss,
        "fp8": cfg.train.fp8,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}t",
        "world": [ctx.world_size, ctx.mode],
    }
