"""The trainer: setup -> loop -> save. The only module that wires data, model, engine and metrics."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..checkpoint import atomic_write_dir, save_checkpoint
from ..config import RunConfig, resolve_max_steps
from ..data.dataset import RowSplit, read_split, tokenize_split
from ..data.loader import TrainLoader, eval_batches
from ..hardware import configure_backends, describe, peak_memory_bytes, pick_device, resolve_precision
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


def get_tokenizer(cfg: RunConfig, split: RowSplit, reporter: ConsoleReporter):
    """The configured tokenizer, the model directory's, or a BPE trained on the training text."""
    source = cfg.model.tokenizer or cfg.model.path
    if source is not None:
        return load_tokenizer(source)
    t = time.perf_counter()
    tok = train_bpe_tokenizer(split.train_texts(), cfg.model.tokenizer_vocab_size)
    reporter.info(f"tokenizer: byte-level BPE trained on the data, {len(tok)} tokens ({time.perf_counter() - t:.1f}s)")
    return tok


def train(cfg: RunConfig, output_dir: Path, reporter: ConsoleReporter | None = None) -> RunResult:
    """Train a model as ``cfg`` says, writing the run directory; returns the trained model too."""
    reporter = reporter or ConsoleReporter()
    wall_start = time.perf_counter()
    split = read_split(cfg.data, cfg.train.seed)  # bad data fails before the run directory exists
    out = prepare_output_dir(output_dir, cfg)

    # ---- setup
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading and shard bars are noise next to our own log
    seed_everything(cfg.train.seed)
    device = pick_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    configure_backends(device)
    reporter.info(f"trainforge {__version__} | {describe(device)} | precision {precision.name} | output {out}")

    tokenizer = get_tokenizer(cfg, split, reporter)
    data = tokenize_split(split, tokenizer, cfg.data.max_length)
    s = data.stats
    reporter.info(
        f"data: {split.format}, {s['train_rows']} train rows -> {s['train_examples']} examples "
        f"({s['train_tokens']:,} tokens); eval {s['eval_rows']} rows -> {s['eval_examples']} examples"
        + (f"; {s['truncated']} truncated to max_length" if s["truncated"] else "")
        + (f"; {s['dropped']} dropped (nothing left to learn after truncation)" if s["dropped"] else "")
    )

    model = build_model(cfg.model, tokenizer, cfg.train.seed).to(device)
    model.train()
    trainable, total = count_parameters(model)
    reporter.info(f"model: {cfg.model.method}, {total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.optim, device)

    pad_id = tokenizer.pad_token_id
    loader = TrainLoader(data.train, cfg.train.micro_batch_size, pad_id, cfg.train.seed, pin=device.type == "cuda")
    max_steps = resolve_max_steps(cfg.train, loader.batches_per_epoch)
    o = cfg.optim
    scheduler = build_scheduler(optimizer, o.schedule, o.warmup_steps, max_steps, o.min_lr_ratio)
    scaler = torch.amp.GradScaler(device.type) if precision.needs_grad_scaler else None
    eval_set = eval_batches(data.eval, cfg.train.micro_batch_size, pad_id, cfg.train.eval_max_batches)

    metrics = MetricsLog(out / "metrics.jsonl")
    eval_before = evaluate(model, eval_set, precision, device)
    if eval_before:
        reporter.info(f"eval before training: loss {eval_before['eval_loss']:.4f} (ppl {eval_before['eval_ppl']:.1f})")
        metrics.write({"step": 0, **eval_before})
    last_eval = eval_before

    # ---- loop
    log_every, accum = cfg.log.every_steps, cfg.train.grad_accum
    batches = iter(loader)
    tokens_seen = 0
    data_wait = 0.0
    last_train_loss: float | None = None
    window_loss = torch.zeros((), device=device)  # summed on device; read only on log steps
    window_steps, window_tokens = 0, 0
    loop_start = window_start = time.perf_counter()
    reporter.start(max_steps)
    try:
        for step in range(1, max_steps + 1):
            t = time.perf_counter()
            micro_batches = [next(batches) for _ in range(accum)]
            data_wait += time.perf_counter() - t

            loss = forward_backward(model, micro_batches, precision, device, scaler)
            grad_norm = optimizer_step(params, optimizer, o.max_grad_norm, scaler)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()

            step_tokens = sum(mb.n_tokens for mb in micro_batches)
            tokens_seen += step_tokens
            window_loss += loss
            window_steps += 1
            window_tokens += step_tokens

            if step % log_every == 0 or step == max_steps:
                now = time.perf_counter()
                rec = {
                    "step": step,
                    "loss": window_loss.item() / window_steps,  # host sync: on log steps only
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens": tokens_seen,
                    "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                    "elapsed_s": now - loop_start,
                }
                metrics.write(rec)
                eta = (now - loop_start) / step * (max_steps - step)
                reporter.log_step(rec, max_steps, eta)
                last_train_loss = rec["loss"]
                window_loss.zero_()
                window_steps, window_tokens, window_start = 0, 0, time.perf_counter()
            else:
                reporter.advance(step)

            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != max_steps and eval_set:
                last_eval = evaluate(model, eval_set, precision, device)
                metrics.write({"step": step, **last_eval})
                reporter.info(f"eval at step {step}: loss {last_eval['eval_loss']:.4f} (ppl {last_eval['eval_ppl']:.1f})")

            every = cfg.checkpoint.every_steps
            if every and (step % every == 0 or step == max_steps):
                state = {
                    "model": {k: v for k, v in model.state_dict().items() if _is_trainable_key(model, k)},
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "loader": {"epoch": loader.epoch, "batch_index": loader.batch_index},
                    "tokens_seen": tokens_seen,
                }
                save_checkpoint(out / "checkpoints", step, state, {"version": __version__}, cfg.checkpoint.keep_last)
    finally:
        reporter.stop()
        metrics.close()
    loop_time = time.perf_counter() - loop_start

    # ---- evaluate, save, report
    if eval_set:
        last_eval = evaluate(model, eval_set, precision, device)
        reporter.info(
            f"eval after training:  loss {last_eval['eval_loss']:.4f} (ppl {last_eval['eval_ppl']:.1f})"
            + (f", was {eval_before['eval_loss']:.4f} before" if eval_before else "")
        )
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": max_steps, **last_eval}) + "\n")

    def write_final(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    final_dir = atomic_write_dir(out / "final", write_final)
    reporter.info(f"saved {final_dir}")

    summary = {
        "trainforge_version": __version__,
        "steps": max_steps,
        "wall_time_s": time.perf_counter() - wall_start,
        "train_time_s": loop_time,
        "tokens": tokens_seen,
        "tokens_per_s": tokens_seen / max(loop_time, 1e-9),
        "data_wait_s": data_wait,
        "peak_memory_bytes": peak_memory_bytes(device),
        "final_train_loss": last_train_loss,
        "eval_loss_before": eval_before.get("eval_loss"),
        "eval_loss": last_eval.get("eval_loss"),
        "eval_ppl": last_eval.get("eval_ppl"),
        "device": str(device),
        "precision": precision.name,
        "parameters": total,
        "trainable_parameters": trainable,
        "data": {"format": split.format, **data.stats},
        "final_dir": str(final_dir),
    }
    if cfg.log.sample_prompt:
        text = sample(model, tokenizer, cfg.log.sample_prompt, cfg.log.sample_tokens, seed=cfg.train.seed)
        model.train()
        summary["sample"] = text
        reporter.info(f"sample ({cfg.log.sample_tokens} tokens after {cfg.log.sample_prompt!r}):\n{text}")
    summary["wall_time_s"] = time.perf_counter() - wall_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    reporter.info(
        f"done: {max_steps} steps, {tokens_seen:,} tokens in {loop_time:.1f}s "
        f"({summary['tokens_per_s']:,.0f} tok/s), wall time {summary['wall_time_s']:.1f}s"
    )
    return RunResult(out, summary, model, tokenizer)


def _is_trainable_key(model: torch.nn.Module, key: str) -> bool:
    """For LoRA only adapter weights go into checkpoints; for full training everything does."""
    if not hasattr(model, "peft_config"):
        return True
    return "lora_" in key
