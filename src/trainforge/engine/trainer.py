"""The trainer: setup -> loop -> save. The only module that wires data, model, engine and metrics."""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..checkpoint import atomic_write_dir, step_dir_name
from ..config import RunConfig, default_cache_dir, resolve_max_steps
from ..data.formats import ALPACA_PROMPT_WITH_INPUT, DEFAULT_CHAT_TEMPLATE
from ..data.loader import Batch, RowCollator, TrainLoader, eval_batches
from ..data.packing import build_rows, weighted_indices
from ..data.prepare import PreparedData, prepare_data, resolve_format, training_texts
from ..dist import DistContext, choose_mode, device_for, init_distributed, shutdown
from ..hardware import (
    Precision,
    available_memory_bytes,
    configure_backends,
    describe,
    peak_flops,
    peak_memory_bytes,
    pick_device,
    resolve_precision,
)
from ..metrics.console import ConsoleReporter
from ..metrics.flops import flops_per_token
from ..metrics.profile import StepProfile, StepTimer
from ..metrics.sinks import TensorBoardSink
from ..metrics.tracker import MetricsLog, NullMetricsLog
from ..metrics.window import LogWindow
from ..model.compile import compile_decoder
from ..model.load import build_model, count_parameters, describe_storage, weight_storage
from ..model.tokenizer import build_char_tokenizer, load_tokenizer, train_bpe_tokenizer
from ..tools.generate import sample
from .compile_auto import HISTORY_FILE, CompileAuto, compile_key
from .evaluate import evaluate
from .memory import estimate_memory, memory_warning
from .nonfinite import NonFiniteGuard
from .oom import fetch_step, forward_backward_adaptive
from .optim import build_optimizer
from .preempt import Interrupted, StopRequest
from .resume import CHECKPOINTS, OutputDirError, capture_state, checkpoint_meta, open_run_dir, restore
from .saver import Checkpointer
from .schedule import build_scheduler
from .sharded import checkpoint_writer, full_model_state
from .step import optimizer_step

__all__ = ["OutputDirError", "Run", "RunResult", "train"]


@dataclass
class RunResult:
    output_dir: Path
    summary: dict[str, Any]
    model: torch.nn.Module
    tokenizer: Any


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_tokenizer(cfg: RunConfig, reporter: ConsoleReporter):
    """The configured tokenizer, the model directory's, or one built from the training text:
    a character vocabulary (``model.tokenizer: char``) or a byte-level BPE.

    Built tokenizers are deterministic functions of the data: a resumed run rebuilds the same
    one (the checkpoint's vocabulary hash checks it), and ``final/`` gets a copy.
    """
    if cfg.model.tokenizer == "char":
        t = time.perf_counter()
        fmt = resolve_format(cfg.data)
        texts = training_texts(cfg.data, fmt)
        # characters the rendering adds around the data's fields: alpaca's prompt, the chat template and roles
        added = {"alpaca": [ALPACA_PROMPT_WITH_INPUT], "chat": [cfg.data.chat_template or DEFAULT_CHAT_TEMPLATE, "system user assistant tool"]}
        tok = build_char_tokenizer(itertools.chain(texts, added.get(fmt, [])))
        reporter.info(f"tokenizer: characters of the data, {len(tok)} tokens ({time.perf_counter() - t:.1f}s)")
        return tok
    source = cfg.model.tokenizer or cfg.model.path
    if source is not None:
        return load_tokenizer(source)
    t = time.perf_counter()
    texts = training_texts(cfg.data, resolve_format(cfg.data))
    tok = train_bpe_tokenizer(texts, cfg.model.tokenizer_vocab_size)
    reporter.info(f"tokenizer: byte-level BPE trained on the data, {len(tok)} tokens ({time.perf_counter() - t:.1f}s)")
    return tok


@dataclass
class DataPlan:
    """Tokenized data arranged into training and eval rows."""

    prepared: PreparedData
    train_rows: list
    eval_rows: list
    collate: RowCollator
    eval_collate: RowCollator | None


def plan_data(cfg: RunConfig, tokenizer, reporter: ConsoleReporter, pin: bool = False) -> DataPlan:
    """Tokenize (or reuse the cache), mix sources by weight, pack into rows."""
    d = cfg.data
    prepared = prepare_data(d, tokenizer, cfg.train.seed, log=reporter.info)
    if (warning := lost_tokens_warning(prepared.stats, d.max_length)) is not None:
        reporter.warn(warning)
    weights = [s.weight for s in d.sources()]
    index = weighted_indices(prepared.train, weights, cfg.train.seed)
    train_rows = build_rows(prepared.train, index, d.packing, d.max_length)
    eval_rows, eval_collate = [], None
    if prepared.eval is not None and len(prepared.eval):
        eval_rows = build_rows(prepared.eval, np.arange(len(prepared.eval)), d.packing, d.max_length)
        eval_collate = RowCollator(prepared.eval, tokenizer.pad_token_id, d.packing, d.max_length)
    collate = RowCollator(prepared.train, tokenizer.pad_token_id, d.packing, d.max_length, pin=pin)
    return DataPlan(prepared, train_rows, eval_rows, collate, eval_collate)


def prepare_only(cfg: RunConfig, reporter: ConsoleReporter | None = None) -> dict[str, Any]:
    """``trainforge prepare``: tokenizer, token cache and packing, with the statistics; no model."""
    reporter = reporter or ConsoleReporter()
    tokenizer = get_tokenizer(cfg, reporter)
    plan = plan_data(cfg, tokenizer, reporter)
    loader = TrainLoader(plan.train_rows, plan.collate, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.packing is False)
    efficiency = loader.padding_efficiency()
    reporter.info(describe_data(plan, efficiency))
    stats = {**plan.prepared.stats, "rows": len(plan.train_rows), "row_efficiency": efficiency}
    reporter.info(f"cache: {plan.prepared.cache_path} (prepared in {stats['prepare_s']:.1f}s)")
    return stats


# share of the data's tokens that truncation (or too_long: drop) may discard before the console says so
LOST_TOKENS_WARN = 0.03


def lost_tokens_warning(stats: dict[str, Any], max_length: int) -> str | None:
    """A console line when more than ``LOST_TOKENS_WARN`` of the tokens were cut off or dropped."""
    if stats.get("lost_token_share", 0.0) <= LOST_TOKENS_WARN:
        return None
    how = "truncation" if stats.get("too_long") == "truncate" else "dropping too-long examples"
    fix = (
        "set data.too_long: split to keep long documents as consecutive blocks"
        if stats["format"] == "text"
        else "raise data.max_length if the model's context allows it"
    )
    return (
        f"data: {how} at data.max_length={max_length} discarded {stats['lost_tokens']:,} tokens, "
        f"{stats['lost_token_share']:.0%} of the data; {fix}"
    )


def describe_data(plan: DataPlan, efficiency: float) -> str:
    s = plan.prepared.stats
    mode = {True: "packed", False: "unpacked", "concat": "concatenated"}[plan.collate.packed or ("concat" if plan.collate.concat else False)]
    notes = [
        f"{s[k]} {label}"
        for k, label in (
            ("truncated", "truncated"),
            ("split", "split into blocks"),
            ("dropped_too_long", "dropped as too long"),
            ("dropped_masked", "dropped with nothing to learn"),
            ("bad_rows", "bad rows skipped"),
            ("eval_overlap_dropped", "dropped as duplicates of eval rows"),
        )
        if s.get(k)
    ]
    return (
        f"data: {s['format']}, {s['train_rows']:,} train rows -> {s['train_sequences']:,} sequences "
        f"({s['train_tokens']:,} tokens) -> {len(plan.train_rows):,} {mode} rows, "
        f"{efficiency:.1%} of row capacity is real tokens; "
        + (f"eval {s['eval_sequences']:,} blocks held out" if s.get("eval_holdout") == "blocks" else f"eval {s['eval_rows']:,} rows")
        + ("; " + ", ".join(notes) if notes else "")
        + (f"\n  bad rows, first: {'; '.join(s['bad_row_examples'])}" if s.get("bad_row_examples") else "")
    )


@dataclass
class Run:
    """Everything a run holds between setup and finish; the loop reads and advances it."""

    cfg: RunConfig
    out: Path
    reporter: ConsoleReporter
    device: torch.device
    precision: Precision
    tokenizer: Any
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    loader: TrainLoader
    eval_set: list[Batch]
    metrics: MetricsLog
    max_steps: int
    data_format: str
    data_stats: dict[str, int]
    saver: Checkpointer
    guard: NonFiniteGuard
    window: LogWindow
    stop: StopRequest
    grad_accum: int  # micro-batches per step: train.grad_accum, multiplied after an out-of-memory back-off
    schedule_steps: int  # horizon of the LR schedule: max_steps, or the original one after a resume
    timer: StepTimer = field(default_factory=lambda: StepTimer(torch.device("cpu")))  # phases of profiled steps
    compiled: bool = False  # the decoder runs through torch.compile
    compile_auto: CompileAuto | None = None  # when to compile (train.compile), from this machine's past measurements
    flops_per_token: float = 0.0  # model FLOPs per trained token (forward + backward), for MFU
    peak_flops: float = 0.0  # of the device in the run's precision; 0: unknown, no MFU
    dist: DistContext = field(default_factory=DistContext)
    train_model: torch.nn.Module | None = None  # what the step runs: the DDP wrapper, else ``model`` itself
    sync: Any = None  # sync(last): context of a micro-batch's backward (gradient exchange on the last only)
    batches: Iterator[Batch] | None = None
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    data_wait_s: float = 0.0
    loop_time_s: float = 0.0
    last_train_loss: float | None = None
    eval_before: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    oom_backoffs: list[dict[str, int]] = field(default_factory=list)
    resumed_from: int | None = None
    precision_reason: str = ""  # why this precision: configured, or what `auto` found on this device

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds (LoRA: adapter weights only); see ``resume.capture_state``."""
        return capture_state(self)


def train(
    cfg: RunConfig, output_dir: Path, reporter: ConsoleReporter | None = None, resume: str = "auto"
) -> RunResult:
    """Train a model as ``cfg`` says, writing the run directory; returns the trained model too.

    ``resume``: ``auto`` continues from the newest complete checkpoint in ``output_dir``,
    ``never`` refuses a directory that holds a run, a path names the checkpoint to continue.
    """
    wall_start = time.perf_counter()
    completed = False
    ctx = init_distributed(pick_device(cfg.train.device).type, cfg.train.dist_timeout_s)
    try:
        if not ctx.is_main:  # only rank 0 prints
            from rich.console import Console

            reporter = ConsoleReporter(Console(quiet=True))
        output_dir = ctx.broadcast_object(Path(output_dir))  # a default name holds the time: rank 0's wins
        with StopRequest() as stop:
            run = setup(cfg, output_dir, reporter or ConsoleReporter(), resume, stop, ctx)
            try:
                train_loop(run)
                run.saver.close()  # the end-of-run checkpoint is reported before final/ and the summary
                result = finish(run, wall_start)
                completed = True
                return result
            finally:
                run.saver.close()
                run.reporter.stop()
                run.metrics.close()
                # drop the DDP wrapper (and its gradient reducer) now, while the process group still
                # lives: freed after it, the reducer would free the group from this thread (see dist.shutdown)
                run.train_model = run.sync = None
    finally:
        if ctx.enabled:
            shutdown(wait_for_peers=completed)  # a failed rank must not wait for peers stuck in its collective


def setup(
    cfg: RunConfig,
    output_dir: Path,
    reporter: ConsoleReporter,
    resume: str = "auto",
    stop: StopRequest | None = None,
    ctx: DistContext | None = None,
) -> Run:
    """Data, tokenizer, model, optimizer, schedule, loaders: everything before the first step."""
    from transformers.utils import logging as hf_logging

    ctx = ctx or DistContext()
    hf_logging.disable_progress_bar()  # weight-loading and shard bars are noise next to our own log
    seed_everything(cfg.train.seed)
    device = device_for(pick_device(cfg.train.device), ctx)
    precision, why = resolve_precision(cfg.train.precision, device, cfg.data.cache_dir)
    configure_backends(device)
    procs = f" | {ctx.world_size} processes" if ctx.enabled else ""
    reporter.info(f"trainforge {__version__} | {describe(device)}{procs} | precision {precision.name} ({why})")
    if precision.name == "fp16" and device.type == "cpu":
        reporter.warn("fp16 on a CPU is emulated and slow: it checks the fp16 + loss-scaling path that older GPUs take; use bf16 or fp32 to train")

    with ctx.main_first():  # rank 0 tokenizes into the cache and checks the run directory; the others reuse both
        tokenizer = get_tokenizer(cfg, reporter)
        data = plan_data(cfg, tokenizer, reporter, pin=device.type == "cuda")  # bad data fails before the run dir exists
        out, resume_plan = open_run_dir(output_dir, cfg, resume, reporter)
    reporter.info(f"output: {out}")
    loader = TrainLoader(
        data.train_rows, data.collate, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.packing is False,
        rank=ctx.rank, world_size=ctx.world_size,
    )
    efficiency = loader.padding_efficiency()
    reporter.info(describe_data(data, efficiency))
    data_stats = {**data.prepared.stats, "rows": len(data.train_rows), "row_efficiency": efficiency}

    model = build_model(
        cfg.model, tokenizer, cfg.train.seed, device, precision.autocast_dtype is not None,
        compute_dtype=precision.autocast_dtype, activation_checkpointing=cfg.train.activation_checkpointing,
    ).to(device)
    model.train()
    trainable, total = count_parameters(model)
    reporter.info(
        f"model: {cfg.model.method}, {total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable, "
        f"attention {model.config._attn_implementation}"
        + (", activation checkpointing" if cfg.train.activation_checkpointing else "")
    )
    reporter.info(f"weights: {describe_storage(weight_storage(model))}")
    train_model = wrap_for_ranks(ctx, cfg, model, loader, precision, device, reporter)
    optimizer = build_optimizer(model, cfg.optim, device)

    max_steps = resolve_max_steps(cfg.train, loader.batches_per_epoch)
    o = cfg.optim
    run = Run(
        cfg=cfg,
        out=out,
        reporter=reporter,
        device=device,
        precision=precision,
        tokenizer=tokenizer,
        model=model,
        params=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, o.schedule, o.warmup_steps, max_steps, o.min_lr_ratio),
        scaler=torch.amp.GradScaler(device.type) if precision.needs_grad_scaler else None,
        loader=loader,
        eval_set=eval_batches(data.eval_rows, data.eval_collate, cfg.train.micro_batch_size, cfg.train.eval_max_batches)
        if data.eval_collate
        else [],
        metrics=MetricsLog(out / "metrics.jsonl", [TensorBoardSink.create(out / "tb")] if cfg.log.tensorboard else [])
        if ctx.is_main
        else NullMetricsLog(),
        timer=StepTimer(device),
        max_steps=max_steps,
        data_format=data.prepared.format,
        data_stats=data_stats,
        saver=Checkpointer(
            out / CHECKPOINTS,
            cfg.checkpoint.model_copy(update={"async_": False}) if ctx.mode == "fsdp" else cfg.checkpoint,
            checkpoint_meta(cfg, tokenizer, {**data_stats, "store": data.prepared.cache_path.name}, ctx.world_size, ctx.mode),
            reporter,
            writer=checkpoint_writer(ctx),
        ),
        guard=NonFiniteGuard(cfg.train.max_skipped_steps, device),
        window=LogWindow.on(device),
        stop=stop or StopRequest(),
        grad_accum=cfg.train.grad_accum,
        schedule_steps=max_steps,
        dist=ctx,
        train_model=train_model,
        sync=ctx.no_sync(train_model),
        precision_reason=why,
    )
    run.compile_auto = CompileAuto(
        cfg.train.compile, compile_key(compile_shape(cfg, model, precision, device, ctx)),
        (cfg.data.cache_dir or default_cache_dir()) / HISTORY_FILE, device,
    )
    run.flops_per_token = flops_per_token(model, cfg.data.max_length)
    device_peak, source = peak_flops(device, precision.name, cfg.data.cache_dir)
    run.peak_flops = device_peak * ctx.world_size  # tokens/s is the global figure: so is the peak
    reporter.info(
        f"compute: {run.flops_per_token / 1e6:.1f} MFLOP per token; device peak "
        + (f"{run.peak_flops / 1e12:.2f} TFLOP/s ({source})" if run.peak_flops else source)
    )
    warn_if_too_big(run)
    if resume_plan is not None:
        restore(run, resume_plan)  # last: it restores the random states that building the run consumed
    return run


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
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}t",
        "world": [ctx.world_size, ctx.mode],
    }


def wrap_for_ranks(
    ctx: DistContext, cfg: RunConfig, model: torch.nn.Module, loader: TrainLoader, precision: Precision,
    device: torch.device, reporter: ConsoleReporter,
) -> torch.nn.Module:
    """Choose DDP or FSDP2 (``train.distributed``) and wrap; alone, the model itself."""
    if not ctx.enabled:
        return model
    est = estimate_memory(model, loader.batch_size, cfg.data.max_length, precision)
    known = [a for a in ctx.all_gather_object(available_memory_bytes(device)) if a is not None]
    ctx.mode, why = choose_mode(  # the same inputs on every rank: all ranks choose alike
        cfg.train.distributed, est.weights + est.grads + est.optimizer, min(known) if known else None, ctx.local_world_size
    )
    g = loader.batch_size * cfg.train.grad_accum * ctx.world_size
    reporter.info(
        f"data parallel: {ctx.mode} over {ctx.world_size} processes ({why}); global batch {g} rows = "
        f"micro-batch {loader.batch_size} x accumulation {cfg.train.grad_accum} x {ctx.world_size} processes"
    )
    wrapped = ctx.wrap(model, device)
    if ctx.rank:
        torch.manual_seed(cfg.train.seed + 1_000_003 * ctx.rank)  # own dropout masks per rank; rank 0 keeps its stream
    return wrapped


def warn_if_too_big(run: Run) -> None:
    """Estimate the run's memory before the first step; warn when the device has less available."""
    estimate = estimate_memory(run.model, run.loader.batch_size, run.cfg.data.max_length, run.precision)
    warning = memory_warning(estimate, available_memory_bytes(run.device), run.device)
    if warning:
        run.reporter.warn(warning)


def run_eval(run: Run, label: str) -> dict[str, float]:
    """Evaluate, log to metrics.jsonl and the console."""
    result = evaluate(run.model, run.eval_set, run.precision, run.device, run.dist, run.cfg.train.fused_loss)
    if result:
        run.metrics.write({"step": run.step, **result})
        run.reporter.info(f"eval {label}: loss {result['eval_loss']:.4f} (ppl {result['eval_ppl']:.1f})")
        run.last_eval = result
    return result


def train_loop(run: Run) -> None:
    """The hot loop: fetch micro-batches, forward/backward, step; log, eval, checkpoint."""
    cfg = run.cfg
    if run.step == 0 and run.resumed_from is None:
        run.eval_before = run_eval(run, "before training")
    run.batches = iter(run.loader)
    first_step, loop_start = run.step, time.perf_counter()
    tick = run.window.started = loop_start
    run.reporter.start(run.max_steps, first_step)
    if not run.compiled:
        compile_if(run, run.compile_auto.at_start(run.max_steps - run.step))
    while run.step < run.max_steps:
        step_start = time.perf_counter()
        position = run.loader.state_dict()  # where this step's examples start: an out-of-memory retry re-reads them
        profile = StepProfile(run.timer, run.step + 1, run.out / "profile") if run.step + 1 in cfg.log.profile_steps else None
        t = time.perf_counter()
        with run.timer.phase("data"):
            micro_batches = fetch_step(run)
        wait = time.perf_counter() - t
        run.data_wait_s += wait
        # all ranks' token counts (the loss divisor) and agreement on stopping / a time-based save
        n_targets, step_tokens, stop, time_due = run.dist.step_totals(
            sum(mb.n_targets for mb in micro_batches),
            sum(mb.n_tokens for mb in micro_batches),
            run.stop.requested,
            run.saver.time_due(),
            run.device,
        )
        if stop:
            run.loader.load_state_dict(position)  # these batches are not trained: the checkpoint resumes at them
            stop_on_signal(run)

        loss, micro_batches = forward_backward_adaptive(run, micro_batches, position, n_targets)
        loss = run.dist.all_reduce(loss)  # the global mean: every rank logs and guards the same value
        with run.timer.phase("optimizer"):
            grad_norm, skipped = optimizer_step(run.params, run.optimizer, cfg.optim.max_grad_norm, run.scaler, loss)
        if profile is not None:
            report_profile(run, profile)
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        run.step += 1

        indices = step_indices(run, micro_batches)
        run.guard.record(skipped, run.step, indices)  # raises after train.max_skipped_steps in a row
        run.tokens_seen += step_tokens
        run.window.add(loss, skipped, step_tokens, indices if cfg.log.example_indices else None, len(indices), wait)
        now = time.perf_counter()
        run.loop_time_s, tick = run.loop_time_s + now - tick, now
        step, last = run.step, run.step == run.max_steps
        run.compile_auto.record_step(now - step_start, run.compiled)  # compile: auto learns from measured steps
        if not run.compiled:
            compile_if(run, run.compile_auto.after_eager_steps(run.max_steps - step))

        if step % cfg.log.every_steps == 0 or last:
            log_step(run, lr, grad_norm, eta=(now - loop_start) / (step - first_step) * (run.max_steps - step))
        else:
            run.reporter.advance(step)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and not last:
            run_eval(run, f"at step {step}")
        run.saver.maybe_save(step, last, run.checkpoint_state, time_due if run.dist.enabled else None)
    run.reporter.stop()


def report_profile(run: Run, profile: StepProfile) -> None:
    """A profiled step's time split, to metrics.jsonl and the console; the trace is on disk."""
    phases = profile.finish()
    run.metrics.write({"step": profile.step, "profile": phases})
    total = sum(phases.values())
    split = ", ".join(f"{k[:-2]} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in phases.items())
    run.reporter.info(f"profile of step {profile.step}: {split}; trace {profile.trace}")


def compile_if(run: Run, reason: str | None) -> None:
    """Compile the decoder now when ``train.compile`` (via ``run.compile_auto``) gave a reason."""
    if reason:
        run.reporter.info(reason)
        run.compiled = compile_decoder(run.model, run.reporter.warn)
    elif run.compile_auto.skip_note:
        run.reporter.info(run.compile_auto.skip_note)
        run.compile_auto.skip_note = None  # said once


def step_indices(run: Run, micro_batches: list[Batch]) -> list[int]:
    """The step's example indices in global order; gathered from all ranks only when
    ``log.example_indices`` asks for them (a collective of host objects every step)."""
    local = [mb.indices for mb in micro_batches]
    if not (run.dist.enabled and run.cfg.log.example_indices):
        return [i for part in local for i in part]
    ranks = run.dist.all_gather_object(local)
    return [i for m in range(len(local)) for part in ranks for i in part[m]]  # rank shares are contiguous


def log_step(run: Run, lr: float, grad_norm: torch.Tensor, eta: float) -> None:
    """Write the window's record to metrics.jsonl and the console (the only host syncs of the loop)."""
    w, now = run.window, time.perf_counter()
    span = max(now - w.started, 1e-9)
    tokens_per_s = w.tokens / span
    rec = {
        "step": run.step,
        "loss": w.mean_loss(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens": run.tokens_seen,
        "tokens_per_s": tokens_per_s,  # real (non-pad) input tokens
        "samples_per_s": w.rows / span,
        "steps_per_s": w.steps / span,
        "mfu": tokens_per_s * run.flops_per_token / run.peak_flops if run.peak_flops else None,
        "data_wait_pct": 100.0 * w.data_wait_s / span,
        "peak_memory_bytes": peak_memory_bytes(run.device),
        "elapsed_s": run.loop_time_s,
        "skipped_steps": int(run.guard.total),
    }
    if run.device.type == "cuda":
        rec["reserved_memory_bytes"] = int(torch.cuda.max_memory_reserved(run.device))
    if run.cfg.log.example_indices:
        rec["example_indices"] = w.indices
    run.metrics.write(rec)
    run.reporter.log_step(rec, run.max_steps, eta)
    run.last_train_loss = rec["loss"]
    w.reset()


def stop_on_signal(run: Run) -> None:
    """SIGTERM/SIGINT arrived: save the finished step and stop (the CLI exits with code 75)."""
    run.reporter.stop()
    saved = run.saver.save_now(run.step, run.checkpoint_state)
    where = f"checkpoint {step_dir_name(run.step)} saved" if saved else "saving a checkpoint failed (see above)"
    raise Interrupted(f"{run.stop.name} at step {run.step}: {where}; run the same command again to resume")


def finish(run: Run, wall_start: float) -> RunResult:
    """Final eval, final/ (HF format, written atomically), summary.json, sample."""
    cfg, out = run.cfg, run.out
    run_eval(run, "after training")
    if run.eval_before and run.last_eval:
        run.reporter.info(f"eval loss {run.eval_before['eval_loss']:.4f} before -> {run.last_eval['eval_loss']:.4f} after")

    # FSDP: every rank hands its shards to rank 0, which writes a plain (unsharded) HF directory
    weights = full_model_state(run.model) if run.dist.mode == "fsdp" else None

    def write_final(tmp: Path) -> None:
        run.model.save_pretrained(tmp, **({"state_dict": weights} if weights is not None else {}))
        run.tokenizer.save_pretrained(tmp)

    final_dir = out / "final"
    if run.dist.is_main:
        atomic_write_dir(final_dir, write_final)
        run.reporter.info(f"saved {final_dir}")
    peak = int(run.dist.all_reduce(torch.tensor(peak_memory_bytes(run.device), device=run.device), "max").item())

    trainable, total = count_parameters(run.model)
    summary = {
        "trainforge_version": __version__,
        "steps": run.step,
        "wall_time_s": 0.0,
        "train_time_s": run.loop_time_s,
        "tokens": run.tokens_seen,
        "tokens_per_s": run.tokens_seen / max(run.loop_time_s, 1e-9),
        "mfu": run.tokens_seen / max(run.loop_time_s, 1e-9) * run.flops_per_token / run.peak_flops if run.peak_flops else None,
        "flops_per_token": run.flops_per_token,
        "compiled": run.compiled,
        "data_wait_s": run.data_wait_s,
        "skipped_steps": int(run.guard.total),
        "micro_batch_size": run.loader.batch_size,
        "grad_accum": run.grad_accum,
        "oom_backoffs": run.oom_backoffs,
        "resumed_from_step": run.resumed_from,
        **run.saver.summary(),
        "peak_memory_bytes": peak,  # the largest of any process
        "world_size": run.dist.world_size,
        "distributed": run.dist.mode,
        "final_train_loss": run.last_train_loss,
        "eval_loss_before": run.eval_before.get("eval_loss"),
        "eval_loss": run.last_eval.get("eval_loss"),
        "eval_ppl": run.last_eval.get("eval_ppl"),
        "device": str(run.device),
        "precision": run.precision.name,
        "precision_reason": run.precision_reason,
        "parameters": total,
        "trainable_parameters": trainable,
        "weights": weight_storage(run.model),  # parameter counts by role and storage dtype
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "data": {"format": run.data_format, **run.data_stats},
        "final_dir": str(final_dir),
    }
    if cfg.log.sample_prompt and (run.dist.is_main or run.dist.mode == "fsdp"):  # FSDP: generating is collective
        text = sample(run.model, run.tokenizer, cfg.log.sample_prompt, cfg.log.sample_tokens, seed=cfg.train.seed,
                      autocast=run.precision.autocast(run.device))
        summary["sample"] = text
        run.reporter.info(f"sample ({cfg.log.sample_tokens} tokens after {cfg.log.sample_prompt!r}):\n{text}")
    summary["wall_time_s"] = time.perf_counter() - wall_start
    if run.dist.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    run.reporter.info(
        f"done: {run.step} steps, {run.tokens_seen:,} tokens in {run.loop_time_s:.1f}s "
        f"({summary['tokens_per_s']:,.0f} tok/s), wall time {summary['wall_time_s']:.1f}s"
    )
    return RunResult(out, summary, run.model, run.tokenizer)
