"""The run directory and resuming: which checkpoint, whether it fits this run, and restoring a run from it.

What must match a checkpoint (``fixed_settings``): the model, data and optimizer sections and
the seed and batch layout of ``train``; the data as tokenized (counts and tokenizer). What may
change: ``train.max_steps`` (longer or shorter, not below the checkpoint's step), device and
precision (the result is then no longer bitwise the same), eval, logging and checkpoint
settings. A longer ``max_steps`` keeps the learning-rate schedule of the original run: its
horizon is saved with the checkpoint, so the steps already planned keep their rates and the
added steps run at the schedule's final rate (``min_lr_ratio`` x ``lr``) instead of the
rate jumping back up mid-run. A new schedule over the longer horizon needs a new run.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import __version__
from ..checkpoint import (
    STEP_PREFIX,
    CheckpointInfo,
    inspect_checkpoint,
    load_checkpoint_state,
    recover_hidden,
    scan_checkpoints,
)
from ..config import RunConfig
from ..errors import TrainforgeError
from ..metrics.console import ConsoleReporter
from ..runlock import OutputDirError
from .schedule import build_scheduler
from .sharded import load_sharded, sharded_state

if TYPE_CHECKING:
    from .run import Run

CHECKPOINTS = "checkpoints"
FIXED_TRAIN_KEYS = ("seed", "micro_batch_size", "grad_accum", "epochs")


class ResumeError(TrainforgeError, RuntimeError):
    """The checkpoint cannot continue this run (it is unusable, or the run's settings changed)."""


@dataclass
class ResumePlan:
    checkpoint: CheckpointInfo
    state: dict[str, Any]
    same_run: bool  # the checkpoint belongs to this output directory: its metrics.jsonl continues


# ---------------------------------------------------------------- what must not change


def fixed_settings(cfg: RunConfig) -> dict[str, Any]:
    """The settings a checkpoint is bound to, flattened to ``section.key`` names."""
    d = cfg.model_dump(mode="json")
    flat: dict[str, Any] = {}
    for section in ("model", "data", "optim"):
        _flatten(d[section], section, flat)
    for key in ("data.cache_dir", "data.num_workers"):  # where and how tokens are made, not what they are
        flat.pop(key, None)
    for key in FIXED_TRAIN_KEYS:
        flat[f"train.{key}"] = d["train"][key]
    return flat


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = node


def data_fingerprint(tokenizer: Any, data_stats: dict[str, Any]) -> dict[str, Any]:
    """What the tokenized data looked like: its integer statistics and a hash of the tokenizer's vocabulary."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    fp: dict[str, Any] = {"tokenizer_vocab": hashlib.sha256(vocab.encode()).hexdigest()[:16]}
    fp.update({k: v for k, v in data_stats.items() if isinstance(v, int) and not isinstance(v, bool)})
    if "store" in data_stats:  # the token store's content key: same files, tokenizer and token settings
        fp["store"] = data_stats["store"]
    return fp


def checkpoint_meta(
    cfg: RunConfig, tokenizer: Any, data_stats: dict[str, Any], world_size: int = 1, mode: str = "none"
) -> dict[str, Any]:
    """meta.json fields beside the step: version, the fixed settings and their hash, the data fingerprint,
    and the processes that wrote it (``world_size``, ``mode``: none | ddp | fsdp)."""
    fixed = fixed_settings(cfg)
    digest = hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "version": __version__,
        "config_hash": digest,
        "fixed": fixed,
        "data": data_fingerprint(tokenizer, data_stats),
        "world_size": world_size,
        "distributed": mode,
    }


def check_world(info: CheckpointInfo, world_size: int, mode: str) -> None:
    """The same number of processes (and the same format) as the run that wrote the checkpoint.

    The global batch is micro_batch_size x grad_accum x processes, so another world size would
    change the optimization mid-run; the data position itself is global and would carry over.
    """
    saved_world, saved_mode = info.meta.get("world_size", 1), info.meta.get("distributed", "none")
    if saved_world != world_size:
        raise ResumeError(
            f"cannot resume from {info.path}: it was written by {saved_world} process(es), this run has {world_size}. "
            f"The global batch (micro_batch_size x grad_accum x processes) would change mid-run: resume with "
            f"{saved_world} process(es) (torchrun --nproc_per_node / trainforge train --nproc), "
            "or start a new run (another --output)"
        )
    if saved_world > 1 and (saved_mode == "fsdp") != (mode == "fsdp"):
        raise ResumeError(
            f"cannot resume from {info.path}: it holds {saved_mode} state and this run uses {mode}; "
            f"set train.distributed: {saved_mode} to resume it"
        )


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    # keys only one side has came or went with a trainforge version: their default is the old behaviour
    shared = sorted(saved.keys() & now.keys())
    return [f"{k}: {saved[k]!r} in the checkpoint, {now[k]!r} now" for k in shared if saved[k] != now[k]]


def check_settings(info: CheckpointInfo, cfg: RunConfig) -> None:
    changed = _differences(info.meta.get("fixed", {}), fixed_settings(cfg))
    if changed:
        raise ResumeError(
            f"cannot resume from {info.path}: settings that a checkpoint is bound to changed: "
            + "; ".join(changed)
            + ". Put them back to continue this run, or start a new one (another --output, or --resume never)"
        )


# ---------------------------------------------------------------- choosing the checkpoint


def open_run_dir(
    output_dir: Path, cfg: RunConfig, resume: str, reporter: ConsoleReporter
) -> tuple[Path, ResumePlan | None]:
    """Check the output directory is writable; find the checkpoint to resume from (``resume``: auto|never|PATH).

    A fresh run gets its ``config.yaml`` here; a resumed one when ``restore`` has checked it.
    """
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(f"cannot write to output directory {out}: {e.strerror}") from None
    metrics = out / "metrics.jsonl"
    holds_run = metrics.exists() and metrics.stat().st_size > 0  # empty: a run that failed in its setup
    if resume == "never":
        if holds_run:
            raise OutputDirError(
                f"{out} already holds a run (metrics.jsonl exists); choose another --output, or --resume auto"
            )
        candidates, same_run = [], False
    elif resume == "auto":
        candidates, same_run = _newest_first(out / CHECKPOINTS, reporter, recover=True), True
        if not candidates and holds_run:
            raise OutputDirError(
                f"{out} already holds a run (metrics.jsonl exists) but no complete checkpoint to resume from; "
                "choose another --output"
            )
    else:
        candidates = _checkpoints_at(Path(resume), reporter)
        same_run = candidates[0].path.parent.resolve() == (out / CHECKPOINTS).resolve()
        if holds_run and not same_run:
            raise OutputDirError(
                f"{out} already holds another run; resuming {candidates[0].path} into it would mix the two runs' "
                "metrics: choose a new --output"
            )
    if not candidates:
        (out / "config.yaml").write_text(cfg.to_yaml())
        return out, None
    return out, _load_first(candidates, cfg, same_run, reporter)


def _newest_first(root: Path, reporter: ConsoleReporter, recover: bool = False) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, newest first; ``recover``: clean up after a crash (own run only:
    another run's directory may belong to a live process in the middle of a save)."""
    for note in recover_hidden(root) if recover else []:
        reporter.info(f"checkpoints: {note} (left by a process that stopped while saving)")
    complete, skipped = scan_checkpoints(root)
    for path, reason in skipped:
        reporter.warn(f"skipping checkpoint {path}: {reason}")
    return complete[::-1]


def _checkpoints_at(path: Path, reporter: ConsoleReporter) -> list[CheckpointInfo]:
    """--resume PATH: a checkpoint directory, a checkpoints/ directory, or a run directory."""
    if path.name.startswith(STEP_PREFIX) or (path / "meta.json").exists():
        found = inspect_checkpoint(path)
        if isinstance(found, str):
            raise ResumeError(f"--resume {path}: not a complete checkpoint: {found}")
        return [found]
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    candidates = _newest_first(root, reporter) if root.is_dir() else []
    if not candidates:
        raise ResumeError(
            f"--resume {path}: no complete checkpoint there (give a run directory or a step-NNNNNNNN one)"
        )
    return candidates


def _load_first(
    candidates: list[CheckpointInfo], cfg: RunConfig, same_run: bool, reporter: ConsoleReporter
) -> ResumePlan:
    """The newest candidate that fits the config and loads; unloadable ones are skipped with a warning."""
    for info in candidates:
        check_settings(info, cfg)
        try:
            state = load_checkpoint_state(info.path)
        except Exception as e:  # a damaged file: zip, pickle or I/O errors alike
            reporter.warn(f"skipping checkpoint {info.path}: it cannot be loaded ({type(e).__name__}: {e})")
            continue
        return ResumePlan(info, state, same_run)
    raise ResumeError("no checkpoint could be loaded: " + ", ".join(str(c.path) for c in candidates))


# ---------------------------------------------------------------- saving and restoring a run


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds: LoRA adapters only, or everything for full training."""
    if hasattr(model, "peft_config"):  # adapters only; the frozen (maybe 4-bit) base is rebuilt from model.path
        return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    return model.state_dict()


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {  # as tensors and numbers: checkpoints load with weights_only=True, no pickled objects
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture_state(run: Run) -> dict[str, Any]:
    """Everything a resume needs to continue exactly where the run is now.

    Data-parallel: all ranks call it together; the random states of every rank are gathered
    (``rng_ranks``), and under FSDP model and optimizer are this rank's shards.
    """
    if run.dist.mode == "fsdp":
        weights = sharded_state(run.model, run.optimizer)
    else:
        weights = {"model": trainable_state(run.model), "optimizer": run.optimizer.state_dict()}
    rng = capture_rng()
    extra = {"rng_ranks": run.dist.all_gather_object(rng)} if run.dist.enabled else {}
    return {
        **weights,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "loader": run.loader.state_dict(),
        "micro_batch_size": run.loader.batch_size,  # after any out-of-memory back-off
        "grad_accum": run.grad_accum,
        "rng": rng,
        **extra,
        "window": run.window.state_dict(),
        "nonfinite": run.guard.state_dict(),
        "counters": {
            "step": run.step,
            "schedule_steps": run.schedule_steps,
            "tokens_seen": run.tokens_seen,
            "data_wait_s": run.data_wait_s,
            "loop_time_s": run.loop_time_s,
            "last_train_loss": run.last_train_loss,
            "eval_before": run.eval_before,
            "last_eval": run.last_eval,
            "metrics_records": run.metrics.records,
            "oom_backoffs": run.oom_backoffs,
            "trackers": run.metrics.tracker_state(),  # W&B / MLflow run ids: a resume continues the same runs
        },
    }


def restore(run: Run, plan: ResumePlan) -> None:
    """Load the checkpoint into a freshly set-up run; random states last, after all of setup used them."""
    info, state, c = plan.checkpoint, plan.state, plan.state["counters"]
    changed = _differences(info.meta.get("data", {}), data_fingerprint(run.tokenizer, run.data_stats))
    if changed:
        raise ResumeError(
            f"cannot resume from {info.path}: the training data differ from the checkpoint's: " + "; ".join(changed)
        )
    if run.max_steps < info.step:
        raise ResumeError(
            f"train.max_steps={run.max_steps} is below the step of {info.path} ({info.step}); give at least {info.step}"
        )
    check_world(info, run.dist.world_size, run.dist.mode)
    if run.dist.mode != "fsdp":
        expected = set(trainable_state(run.model))
        if set(state["model"]) != expected:
            raise ResumeError(
                f"cannot resume from {info.path}: its weights do not match this model "
                f"({len(state['model'])} tensors, {len(expected)} expected)"
            )

    o = run.cfg.optim
    run.schedule_steps = c["schedule_steps"]
    run.scheduler = build_scheduler(run.optimizer, o.schedule, o.warmup_steps, run.schedule_steps, o.min_lr_ratio)
    if run.dist.mode == "fsdp":
        load_sharded(run.model, run.optimizer, info.path)
    else:
        run.model.load_state_dict(state["model"], strict=False)
        run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if run.scaler is not None and state["scaler"] is not None:
        run.scaler.load_state_dict(state["scaler"])
    run.loader.load_state_dict(state["loader"])
    run.loader.batch_size, run.grad_accum = state["micro_batch_size"], state["grad_accum"]
    run.window.load_state_dict(state["window"])
    run.guard.load_state_dict(state["nonfinite"])
    run.step, run.resumed_from = c["step"], c["step"]
    run.tokens_seen, run.data_wait_s, run.loop_time_s = c["tokens_seen"], c["data_wait_s"], c["loop_time_s"]
    run.last_train_loss, run.eval_before, run.last_eval = c["last_train_loss"], c["eval_before"], c["last_eval"]
    run.oom_backoffs = list(c["oom_backoffs"])
    if plan.same_run:
        dropped = run.metrics.truncate(c["metrics_records"])
        if dropped:
            run.reporter.info(f"metrics.jsonl: dropped {dropped} records written after {info.path.name}")
    if run.dist.is_main:
        (run.out / "config.yaml").write_text(run.cfg.to_yaml())
    restore_rng(state["rng_ranks"][run.dist.rank] if "rng_ranks" in state else state["rng"])

    notes = [f"resuming from {info.path} (step {info.step} of {run.max_steps})"]
    if run.max_steps != run.schedule_steps:
        notes.append(
            f"the learning-rate schedule keeps its {run.schedule_steps}-step horizon (train.max_steps is now {run.max_steps})"
        )
    if run.grad_accum != run.cfg.train.grad_accum:
        notes.append(
            f"micro-batch {run.loader.batch_size} x accumulation {run.grad_accum}, as chosen after running out of memory"
        )
    if info.meta.get("version") != __version__:
        notes.append(f"the checkpoint was written by trainforge {info.meta.get('version')}")
    run.reporter.info("; ".join(notes))
