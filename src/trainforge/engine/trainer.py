"""The trainer: setup -> loop -> save. The only module that wires data, model, engine and metrics."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..checkpoint import atomic_write_dir, save_checkpoint
from ..config import RunConfig, resolve_max_steps
from ..data.loader import Batch, RowCollator, TrainLoader, eval_batches
from ..data.packing import build_rows, weighted_indices
from ..data.prepare import PreparedData, prepare_data, resolve_format, training_texts
from ..hardware import Precision, configure_backends, describe, peak_memory_bytes, pick_device, resolve_precision
from ..metrics.console import ConsoleReporter
from ..metrics.tracker import MetricsLog
from ..model.load import build_model, count_parameters
from ..model.tokenizer import load_tokenizer, train_bpe_tokenizer
from ..tools.generate import sample
from .evaluate import evaluate
from .optim import build_optimizer
from .schedule import build_scheduler
from .step import forward_backward, optimizer_step


class OutputDirError(RuntimeError):
    """The output directory cannot be used for this run."""


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


def prepare_output_dir(output_dir: Path, cfg: RunConfig) -> Path:
    """Create the run directory, check it is writable and fresh, write the resolved config."""
    output_dir = Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(f"cannot write to output directory {output_dir}: {e.strerror}") from None
    if (output_dir / "metrics.jsonl").exists():
        raise OutputDirError(f"{output_dir} already holds a run (metrics.jsonl exists); choose another --output")
    (output_dir / "config.yaml").write_text(cfg.to_yaml())
    return output_dir


def get_tokenizer(cfg: RunConfig, reporter: ConsoleReporter):
    """The configured tokenizer, the model directory's, or a BPE trained on the training text."""
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
        f"{efficiency:.1%} of row capacity is real tokens; eval {s['eval_rows']:,} rows"
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
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    data_wait_s: float = 0.0
    loop_time_s: float = 0.0
    last_train_loss: float | None = None
    eval_before: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds (LoRA: adapter weights only)."""
        return {
            "model": {k: v for k, v in self.model.state_dict().items() if _is_trainable_key(self.model, k)},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "loader": self.loader.state_dict(),
            "tokens_seen": self.tokens_seen,
        }


def train(cfg: RunConfig, output_dir: Path, reporter: ConsoleReporter | None = None) -> RunResult:
    """Train a model as ``cfg`` says, writing the run directory; returns the trained model too."""
    wall_start = time.perf_counter()
    run = setup(cfg, output_dir, reporter or ConsoleReporter())
    try:
        train_loop(run)
        return finish(run, wall_start)
    finally:
        run.reporter.stop()
        run.metrics.close()


def setup(cfg: RunConfig, output_dir: Path, reporter: ConsoleReporter) -> Run:
    """Data, tokenizer, model, optimizer, schedule, loaders: everything before the first step."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading and shard bars are noise next to our own log
    seed_everything(cfg.train.seed)
    device = pick_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    configure_backends(device)
    reporter.info(f"trainforge {__version__} | {describe(device)} | precision {precision.name}")

    tokenizer = get_tokenizer(cfg, reporter)
    plan = plan_data(cfg, tokenizer, reporter, pin=device.type == "cuda")  # bad data fails before the run dir exists
    out = prepare_output_dir(output_dir, cfg)
    reporter.info(f"output: {out}")
    loader = TrainLoader(plan.train_rows, plan.collate, cfg.train.micro_batch_size, cfg.train.seed, cfg.data.packing is False)
    efficiency = loader.padding_efficiency()
    reporter.info(describe_data(plan, efficiency))

    model = build_model(cfg.model, tokenizer, cfg.train.seed, device).to(device)
    model.train()
    trainable, total = count_parameters(model)
    reporter.info(
        f"model: {cfg.model.method}, {total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable, "
        f"attention {model.config._attn_implementation}"
    )
    optimizer = build_optimizer(model, cfg.optim, device)

    max_steps = resolve_max_steps(cfg.train, loader.batches_per_epoch)
    o = cfg.optim
    return Run(
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
        eval_set=eval_batches(plan.eval_rows, plan.eval_collate, cfg.train.micro_batch_size, cfg.train.eval_max_batches)
        if plan.eval_collate
        else [],
        metrics=MetricsLog(out / "metrics.jsonl"),
        max_steps=max_steps,
        data_format=plan.prepared.format,
        data_stats={**plan.prepared.stats, "rows": len(plan.train_rows), "row_efficiency": efficiency},
    )


def run_eval(run: Run, label: str) -> dict[str, float]:
    """Evaluate, log to metrics.jsonl and the console."""
    result = evaluate(run.model, run.eval_set, run.precision, run.device)
    if result:
        run.metrics.write({"step": run.step, **result})
        run.reporter.info(f"eval {label}: loss {result['eval_loss']:.4f} (ppl {result['eval_ppl']:.1f})")
        run.last_eval = result
    return result


def train_loop(run: Run) -> None:
    """The hot loop: fetch micro-batches, forward/backward, step; log, eval, checkpoint."""
    cfg, o, device = run.cfg, run.cfg.optim, run.device
    if run.step == 0:
        run.eval_before = run_eval(run, "before training")
    batches = iter(run.loader)
    window_loss = torch.zeros((), device=device)  # summed on device; read only on log steps
    window_steps, window_tokens = 0, 0
    loop_start = window_start = time.perf_counter()
    first_step = run.step
    run.reporter.start(run.max_steps, first_step)
    while run.step < run.max_steps:
        t = time.perf_counter()
        micro_batches = [next(batches) for _ in range(cfg.train.grad_accum)]
        run.data_wait_s += time.perf_counter() - t

        loss = forward_backward(run.model, micro_batches, run.precision, device, run.scaler)
        grad_norm = optimizer_step(run.params, run.optimizer, o.max_grad_norm, run.scaler)
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        run.step += 1

        step_tokens = sum(mb.n_tokens for mb in micro_batches)
        run.tokens_seen += step_tokens
        window_loss += loss
        window_steps += 1
        window_tokens += step_tokens
        step, last = run.step, run.step == run.max_steps

        if step % cfg.log.every_steps == 0 or last:
            now = time.perf_counter()
            rec = {
                "step": step,
                "loss": window_loss.item() / window_steps,  # host sync: on log steps only
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens": run.tokens_seen,
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": run.loop_time_s + now - loop_start,
            }
            run.metrics.write(rec)
            eta = (now - loop_start) / (step - first_step) * (run.max_steps - step)
            run.reporter.log_step(rec, run.max_steps, eta)
            run.last_train_loss = rec["loss"]
            window_loss.zero_()
            window_steps, window_tokens, window_start = 0, 0, time.perf_counter()
        else:
            run.reporter.advance(step)

        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and not last:
            run_eval(run, f"at step {step}")

        every = cfg.checkpoint.every_steps
        if every and (step % every == 0 or last):
            save_checkpoint(
                run.out / "checkpoints", step, run.checkpoint_state(), {"version": __version__}, cfg.checkpoint.keep_last
            )
    run.loop_time_s += time.perf_counter() - loop_start
    run.reporter.stop()


def finish(run: Run, wall_start: float) -> RunResult:
    """Final eval, final/ (HF format, written atomically), summary.json, sample."""
    cfg, out = run.cfg, run.out
    run_eval(run, "after training")
    if run.eval_before and run.last_eval:
        run.reporter.info(f"eval loss {run.eval_before['eval_loss']:.4f} before -> {run.last_eval['eval_loss']:.4f} after")

    def write_final(tmp: Path) -> None:
        run.model.save_pretrained(tmp)
        run.tokenizer.save_pretrained(tmp)

    final_dir = atomic_write_dir(out / "final", write_final)
    run.reporter.info(f"saved {final_dir}")

    trainable, total = count_parameters(run.model)
    summary = {
        "trainforge_version": __version__,
        "steps": run.step,
        "wall_time_s": 0.0,
        "train_time_s": run.loop_time_s,
        "tokens": run.tokens_seen,
        "tokens_per_s": run.tokens_seen / max(run.loop_time_s, 1e-9),
        "data_wait_s": run.data_wait_s,
        "peak_memory_bytes": peak_memory_bytes(run.device),
        "final_train_loss": run.last_train_loss,
        "eval_loss_before": run.eval_before.get("eval_loss"),
        "eval_loss": run.last_eval.get("eval_loss"),
        "eval_ppl": run.last_eval.get("eval_ppl"),
        "device": str(run.device),
        "precision": run.precision.name,
        "parameters": total,
        "trainable_parameters": trainable,
        "data": {"format": run.data_format, **run.data_stats},
        "final_dir": str(final_dir),
    }
    if cfg.log.sample_prompt:
        text = sample(run.model, run.tokenizer, cfg.log.sample_prompt, cfg.log.sample_tokens, seed=cfg.train.seed)
        summary["sample"] = text
        run.reporter.info(f"sample ({cfg.log.sample_tokens} tokens after {cfg.log.sample_prompt!r}):\n{text}")
    summary["wall_time_s"] = time.perf_counter() - wall_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    run.reporter.info(
        f"done: {run.step} steps, {run.tokens_seen:,} tokens in {run.loop_time_s:.1f}s "
        f"({summary['tokens_per_s']:,.0f} tok/s), wall time {summary['wall_time_s']:.1f}s"
    )
    return RunResult(out, summary, run.model, run.tokenizer)


def _is_trainable_key(model: torch.nn.Module, key: str) -> bool:
    """For LoRA only adapter weights go into checkpoints; for full training everything does."""
    if not hasattr(model, "peft_config"):
        return True
    return "lora_" in key
