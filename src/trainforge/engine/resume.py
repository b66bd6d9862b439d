"""Resuming: which checkpoint continues a run, and whether it fits it (``Run.load_state_dict`` restores it).

What must match a checkpoint (``fixed_settings``): the model, data and optimizer sections and
the seed and batch layout of ``train``; the data as tokenized (counts and tokenizer). What may
change: the run's length, ``train.max_steps`` or ``train.epochs`` (longer or shorter, not below the
checkpoint's step), device and
precision (the result is then no longer bitwise the same), eval, logging and checkpoint
settings. A longer ``max_steps`` keeps the learning-rate schedule of the original run: its
horizon is saved with the checkpoint, so the steps already planned keep their rates and the
added steps run at the schedule's final rate (``min_lr_ratio`` x ``lr``) instead of the
rate jumping back up mid-run. A new schedule over the longer horizon needs a new run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..rundir.checkpoint import (
    STEP_PREFIX,
    CheckpointInfo,
    has_checksums,
    inspect_checkpoint,
    load_checkpoint_state,
    recover_hidden,
    scan_checkpoints,
    verify_checkpoint,
)
from ..config.run import RunConfig, TrainSettings, resolve_grad_accum
from ..metrics.console import ConsoleReporter
from ..metrics.sink import flat_config
from ..metrics.tracker import EVENTS_FILE
from ..model.weight_files import weights_fingerprint
from ..rundir.lock import RUN_MARKER, OutputDirError, probe_run_dir
from .nonfinite import checkpoint_tensors, describe, nonfinite_tensors
from .state import ResumeError, resumed_grad_accum, trainable_state  # ResumeError is raised here and imported from here

if TYPE_CHECKING:
    from .run import Run  # for annotations only: the run module imports nothing of this one

CHECKPOINTS = "checkpoints"
ATTEMPTS = "attempts"  # start_again moves the files of a run that died before its first checkpoint here
# what a run writes besides checkpoints/ (kept: partial saves are recovered or skipped) and lease.json (ours)
ATTEMPT_FILES = ("metrics.jsonl", "events.jsonl", "report.html", "config.yaml", "tb", "wandb", "profile")
FIXED_TRAIN_KEYS = ("seed", "micro_batch_size", "grad_accum")
STORE_CHANGED = ("the tokenized data (the token store's key: the bytes of data.train and data.eval, the tokenizer and the "
                 "data settings) changed: rows were edited, reordered, or a preference pair's sides swapped")


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
        flat.update(flat_config(d[section], section))
    for key in ("data.cache_dir", "data.num_workers"):  # where and how tokens are made, not what they are
        flat.pop(key, None)
    for key in FIXED_TRAIN_KEYS:
        flat[f"train.{key}"] = d["train"][key]
    return flat


def data_fingerprint(tokenizer: Any, data_stats: dict[str, Any]) -> dict[str, Any]:
    """What the tokenized data looked like: its integer statistics and a hash of the tokenizer's vocabulary."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    fp: dict[str, Any] = {"tokenizer_vocab": hashlib.sha256(vocab.encode()).hexdigest()[:16]}
    fp.update({k: v for k, v in data_stats.items() if isinstance(v, int) and not isinstance(v, bool)})
    if "store" in data_stats:  # the token store's content key: every byte of the data files, tokenizer and token
        fp["store"] = data_stats["store"]  # settings (what counts alone miss: a pair's sides swapped, a word changed)
    return fp


def checkpoint_meta(
    cfg: RunConfig, tokenizer: Any, data_stats: dict[str, Any], world_size: int = 1, mode: str = "none"
) -> dict[str, Any]:
    """meta.json fields beside the step: version, the fixed settings and their hash, the data fingerprint,
    and the processes that wrote it (``world_size``, ``mode``: none | ddp | fsdp)."""
    fixed = fixed_settings(cfg)
    digest = hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]
    meta = {
        "version": __version__,
        "config_hash": digest,
        "fixed": fixed,
        "data": data_fingerprint(tokenizer, data_stats),
        "world_size": world_size,
        "distributed": mode,
    }
    if (weights := base_weights(cfg)) is not None:
        meta["model_weights"] = weights
    return meta


def base_weights(cfg: RunConfig) -> str | None:
    """The fingerprint of the weights at ``model.path`` (``weights_fingerprint``): what adapters train on and a
    preference reference compares with; None for a model built from ``model.init`` or named by a hub id."""
    return weights_fingerprint(Path(cfg.model.path)) if cfg.model.path else None


def check_world(info: CheckpointInfo, world_size: int, cfg: RunConfig, mode: str | None = None) -> None:
    """The number of processes (and, given ``mode``, the format) of the run that wrote the checkpoint, or another
    number where the global batch stays the same.

    The global batch is micro_batch_size x grad_accum x processes, so another number of processes changes the
    optimization mid-run unless ``train.global_batch_size`` holds it: then grad_accum follows the processes
    (``resumed_grad_accum``), each step trains the same rows in the same order (the data position counts global
    rows), and the run continues on 4 GPUs where it was preempted on 8. FSDP shards are bound to their processes.
    """
    saved_world, saved_mode = info.meta.get("world_size", 1), info.meta.get("distributed", "none")
    if mode is None and world_size > 1 and cfg.train.distributed == "fsdp":  # before the model loads: as configured
        mode = "fsdp"
    if saved_world != world_size:
        if saved_mode == "fsdp":
            raise ResumeError(
                f"cannot resume from {info.path}: it was written by {saved_world} process(es), this run has {world_size}, "
                f"and FSDP's sharded state resumes on the processes that wrote it: resume with {saved_world} "
                "process(es), or start a new run (another --output)"
            )
        if mode == "fsdp":
            raise ResumeError(
                f"cannot resume from {info.path} ({saved_mode if saved_world > 1 else 'one process'}'s state) on "
                f"{world_size} processes sharded with FSDP: set train.distributed: ddp to continue it there"
            )
        if cfg.train.global_batch_size is None:
            fixed = info.meta.get("fixed", {})
            micro, accum = fixed.get("train.micro_batch_size"), fixed.get("train.grad_accum")
            hold = (f"set train.global_batch_size to the checkpoint's global batch in place of train.grad_accum to keep "
                    f"it on {world_size}, ")
            if isinstance(micro, int) and isinstance(accum, int):
                # the micro-batch stays the checkpoint's: only counts whose rows per pass divide the global batch hold it
                rows = micro * accum * saved_world
                fits = [n for n in range(1, rows // micro + 1) if rows % (micro * n) == 0]
                hold = (f"set train.global_batch_size: {rows} (the checkpoint's global batch) in place of train.grad_accum to "
                        f"keep it on {world_size}, " if world_size in fits else
                        f"set train.global_batch_size: {rows} in place of train.grad_accum to resume on "
                        f"{', '.join(map(str, fits))} processes (where {micro} rows x processes divide it), ")
            raise ResumeError(
                f"cannot resume from {info.path}: it was written by {saved_world} process(es), this run has {world_size}. "
                f"The global batch (micro_batch_size x grad_accum x processes) would change mid-run: resume with "
                f"{saved_world} process(es) (torchrun --nproc_per_node / trainforge train --nproc), {hold}"
                "or start a new run (another --output)"
            )
    if mode is not None and saved_world > 1 and (saved_mode == "fsdp") != (mode == "fsdp"):
        raise ResumeError(
            f"cannot resume from {info.path}: it holds {saved_mode} state and this run uses {mode}; "
            f"set train.distributed: {saved_mode} to resume it"
        )


def bound_grad_accum(t: TrainSettings, world_size: int) -> int:
    """The grad_accum a checkpoint binds (``fixed_settings``): ``resolve_grad_accum``'s at the configured micro-batch;
    where that micro-batch x processes does not divide ``global_batch_size`` (an out-of-memory back-off's smaller
    micro-batch resumed on more processes), the global batch in configured micro-batches, as every resume derives it
    alike (the run's own accumulation is ``resumed_grad_accum``'s)."""
    g = t.global_batch_size
    if g is not None and isinstance(t.micro_batch_size, int) and g % (t.micro_batch_size * world_size):
        return max(1, g // t.micro_batch_size)
    return resolve_grad_accum(t, world_size)


def resumes_a_checkpoint(out: Path, resume: str) -> bool:
    """Whether this run will continue a checkpoint (``resume``: a path, or auto where ``out`` holds a complete one);
    reads meta.json files only."""
    if resume == "never":
        return False
    return resume != "auto" or bool(scan_checkpoints(out / CHECKPOINTS)[0])


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    # keys only one side has came or went with a trainforge version: their default is the old behaviour
    shared = sorted(saved.keys() & now.keys())
    return [f"{k}: {saved[k]!r} in the checkpoint, {now[k]!r} now" for k in shared if saved[k] != now[k]]


def resolved_against(info: CheckpointInfo, cfg: RunConfig) -> dict[str, Any]:
    """``fixed_settings(cfg)`` as the run resolves them when it resumes ``info`` (a checkpoint binds resolved values):
    ``micro_batch_size: auto`` takes the checkpoint's micro-batch (``fit_to_machine`` keeps it), ``data.max_length:
    auto`` its length (``row_length.fit_length`` keeps it), and a grad_accum that ``global_batch_size`` derives is
    derived from that (at the checkpoint's process count: another count is ``check_world``'s to refuse)."""
    t = cfg.train
    saved_length = info.meta.get("fixed", {}).get("data.max_length")
    if cfg.data.max_length == "auto" and isinstance(saved_length, int):
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": saved_length})})
    saved_micro = info.meta.get("fixed", {}).get("train.micro_batch_size")
    if t.micro_batch_size == "auto" and isinstance(saved_micro, int):
        t = t.model_copy(update={"micro_batch_size": saved_micro})
    if t.global_batch_size is not None and t.micro_batch_size != "auto":
        t = t.model_copy(update={"grad_accum": bound_grad_accum(t, int(info.meta.get("world_size", 1)))})
    return fixed_settings(cfg.model_copy(update={"train": t}))


def check_settings(info: CheckpointInfo, cfg: RunConfig) -> None:
    saved, now = dict(info.meta.get("fixed", {})), resolved_against(info, cfg)
    weights = [] if "model_weights" not in info.meta else _base_weights_changed(info, cfg, saved, now)
    changed = weights + _differences(saved, now)
    if cfg.train.global_batch_size is not None:  # the grad_accum the user did not set comes from the batch they did
        changed = [c + f" (derived from train.global_batch_size: {cfg.train.global_batch_size}; the checkpoint's run "
                   "had a global batch of micro_batch_size x grad_accum x processes)" if c.startswith("train.grad_accum:") else c
                   for c in changed]
    if changed:
        raise ResumeError(
            f"cannot resume from {info.path}: settings that a checkpoint is bound to changed: "
            + "; ".join(changed)
            + ". Put them back to continue this run, or start a new one with another --output"
        )


def _base_weights_changed(info: CheckpointInfo, cfg: RunConfig, saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The base model against the checkpoint's (``model_weights``): other weights at ``model.path`` are a change (the
    path alone was compared: a LoRA run resumed on another base); the same weights under another spelling of the
    path (relative, moved) are not, so ``model.path`` leaves the comparison of ``saved`` and ``now``."""
    current = base_weights(cfg)
    if current is None:
        return []
    saved.pop("model.path", None)
    now.pop("model.path", None)
    if current == info.meta["model_weights"]:
        return []
    return [f"the weights at model.path {cfg.model.path} are not those the checkpoint trained from (config.json or the "
            "weight files differ)"]


def refuse_changed_settings(out: Path, cfg: RunConfig, resume: str, world_size: int = 1) -> None:
    """Before the data is tokenized and the model loaded: a rerun (``--resume auto``) whose bound settings differ
    from its newest checkpoint's is refused now, as ``choose_checkpoint`` refuses it later (a changed
    ``data.max_length`` once tokenized a whole corpus again before the refusal)."""
    if resume == "auto":
        complete, _ = scan_checkpoints(out / CHECKPOINTS)
        if complete:
            check_settings(complete[-1], cfg)
            check_world(complete[-1], world_size, cfg)


# ---------------------------------------------------------------- choosing the checkpoint


def choose_checkpoint(
    out: Path, cfg: RunConfig, resume: str, reporter: ConsoleReporter, world_size: int = 1, main: bool = True
) -> ResumePlan | None:
    """The checkpoint to continue from (``resume``: auto|never|PATH), loaded; None for a fresh run, or (auto) for
    a run that ended before its first checkpoint, which starts again (``start_again``, by the ``main`` process only:
    every rank chooses, one moves the files).
    Refuses an output directory that holds another run (runlock.probe_run_dir), and a checkpoint written by
    another number of processes before its state is read (an 8B run's optimizer state is tens of GB) and
    before the model loads."""
    holds_run = probe_run_dir(out)
    if resume == "never":
        if holds_run:
            raise OutputDirError(
                f"{out} already holds a run (metrics.jsonl exists); choose another --output, or --resume auto"
            )
        candidates, same_run = [], False
    elif resume == "auto":
        candidates, same_run = _newest_first(out / CHECKPOINTS, reporter, recover=True), True
        if not candidates and (holds_run or stopped_in_setup(out)):
            if main:
                start_again(out, reporter)
            elif refused := unfinished_without_checkpoint(out):  # every rank refuses alike (none waits for a peer)
                raise OutputDirError(refused)
    else:
        candidates = _checkpoints_at(Path(resume), reporter)
        same_run = candidates[0].path.parent.resolve() == (out / CHECKPOINTS).resolve()
        if holds_run and not same_run:
            raise OutputDirError(
                f"{out} already holds another run; resuming {candidates[0].path} into it would mix the two runs' "
                "metrics: choose a new --output"
            )
    if not candidates:
        return None
    check_world(candidates[0], world_size, cfg)
    return _load_first(candidates, cfg, same_run, reporter)


def wrote_its_end(out: Path) -> bool:
    """The run in ``out`` wrote what ends it, ``summary.json`` and ``final/`` (after its final evaluation)."""
    return (out / "summary.json").is_file() and (out / "final").is_dir()


def stopped_in_setup(out: Path) -> bool:
    """``out`` holds the events of an attempt that logged no metrics record (a signal during set-up or the evaluation
    before training: its ``stop`` event): the run starts again as one killed later does, that attempt's files moved
    to attempts/N, rather than appending to its events.jsonl."""
    events = out / EVENTS_FILE
    return (out / RUN_MARKER).is_file() and events.is_file() and events.stat().st_size > 0


def unfinished_without_checkpoint(out: Path) -> str | None:
    """Why ``out``, a run directory that holds no complete checkpoint, cannot start again from step 0 (None: it can).

    It can when it holds a trainforge run (its ``.trainforge-run`` marker) that did not finish (no summary.json
    nor final/): stopped or killed before its first checkpoint, nothing of it can be continued. Its settings
    bind nothing then (no trained state to be incompatible with), so another model, data or optimizer is fine.
    A live holder never gets here: the run directory's lease refuses it first (rundir/lock.py)."""
    if not (out / RUN_MARKER).is_file():  # metrics.jsonl without the marker: maybe another tool's directory
        return (f"{out} already holds a run (metrics.jsonl exists) but no complete checkpoint to resume from, and "
                f"no {RUN_MARKER} marker to show trainforge wrote it; choose another --output")
    if (out / "summary.json").is_file() or (out / "final").is_dir():
        return (f"{out} holds a finished run (summary.json, final/) but no complete checkpoint to train on from; "
                "choose another --output")
    return None


def start_again(out: Path, reporter: ConsoleReporter) -> Path:
    """``out`` holds a run stopped or killed before its first checkpoint (``unfinished_without_checkpoint``): move
    that attempt's files into ``out/attempts/N/`` (metrics.jsonl, events.jsonl, report.html, ...: ``trainforge
    report`` and ``doctor`` read it there) so the new run starts from step 0 with a log of its own; returns
    where they went. Moved rather than deleted: they may be all that says why it died (a loss going up, the
    step it was killed at)."""
    refused = unfinished_without_checkpoint(out)
    if refused:
        raise OutputDirError(refused)
    n = 1
    while (out / ATTEMPTS / str(n)).exists():
        n += 1
    dest = out / ATTEMPTS / str(n)
    try:
        dest.mkdir(parents=True)
        (dest / RUN_MARKER).write_text("an earlier attempt of a trainforge run, moved aside\n")
        for name in ATTEMPT_FILES:
            if (out / name).exists():
                os.replace(out / name, dest / name)  # one rename each: the same filesystem
    except OSError as e:
        raise OutputDirError(f"cannot move the earlier attempt's files of {out} into {dest}: {e}") from None
    reporter.info(f"{out}: no checkpoint (stopped before its first one): starting again from step 0; "
                  f"the earlier attempt's files are in {dest}")
    return dest


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
    """The newest candidate that fits the config, matches its checksums, loads and holds finite weights and
    optimizer state; the others are skipped with a warning (the reason named), the previous one tried."""
    skipped: list[str] = []
    for info in candidates:
        check_settings(info, cfg)
        if not has_checksums(info):  # written before checksums existed: sizes checked, bytes cannot be
            reporter.info(f"checkpoint {info.path} records no checksums (an older trainforge wrote it): not verified")
        reason, state = checkpoint_fault(info)
        if reason is not None or state is None:
            reporter.warn(f"skipping checkpoint {info.path}: {reason}")
            skipped.append(f"{info.path} ({reason})")
            continue
        return ResumePlan(info, state, same_run)
    raise ResumeError("no checkpoint could be loaded: " + "; ".join(skipped))


def checkpoint_fault(info: CheckpointInfo, mmap: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    """Why a complete checkpoint cannot be resumed (None: it can), and its state when it can: its checksums, then
    loading ``state.pt``, then finite weights and optimizer state. Resuming and ``doctor`` judge alike with it;
    ``mmap``: map the file rather than read it into memory (``doctor``: an 8B run's state is tens of GB)."""
    reason = verify_checkpoint(info)  # reads each checksummed file once, streaming
    if reason is not None:
        return reason, None
    try:
        state = load_checkpoint_state(info.path, mmap=mmap)
    except Exception as e:  # a damaged file: zip, pickle or I/O errors alike
        return f"it cannot be loaded ({type(e).__name__}: {e})", None
    found = nonfinite_tensors(checkpoint_tensors(state))
    if found:
        return f"its weights or optimizer state are not finite: {describe(found)}", None
    return None, state


# ---------------------------------------------------------------- whether it continues this run


def check_fits_run(plan: ResumePlan, run: Run) -> None:
    """The chosen checkpoint continues ``run``: the same data as tokenized, a ``max_steps`` not below its
    step, the same processes, the same trained tensors."""
    info, state = plan.checkpoint, plan.state
    changed = _differences(info.meta.get("data", {}), run.saver.meta["data"])  # what this run's checkpoints will hold
    if changed:
        raise ResumeError(
            f"cannot resume from {info.path}: the training data differ from the checkpoint's: "
            + "; ".join(STORE_CHANGED if c.startswith("store:") else c for c in changed)
            + ". Put the data files back as they were to continue this run, or start a new one with another --output"
        )
    if run.max_steps < info.step:
        raise ResumeError(
            f"{run_length(run)} is below the step of {info.path} ({info.step}); give train.max_steps of at least {info.step}"
        )
    check_world(info, run.dist.world_size, run.cfg, run.dist.mode)
    resumed_grad_accum(state, run.dist.world_size)
    if run.dist.mode != "fsdp":
        expected = set(trainable_state(run.model))
        if set(state["model"]) != expected:
            raise ResumeError(
                f"cannot resume from {info.path}: its weights do not match this model "
                f"({len(state['model'])} tensors, {len(expected)} expected)"
            )


def length_key(cfg: RunConfig) -> str:
    """The key that sets the run's length: ``train.epochs`` when it is given (and max_steps not), else ``train.max_steps``."""
    return "train.epochs" if cfg.train.max_steps is None and cfg.train.epochs is not None else "train.max_steps"


def run_length(run: Run) -> str:
    """The setting that makes the run's length, with its steps: ``train.max_steps=9`` or ``train.epochs=2 (14 steps)``."""
    if length_key(run.cfg) == "train.epochs":
        return f"train.epochs={run.cfg.train.epochs:g} ({run.max_steps} steps)"
    return f"train.max_steps={run.max_steps}"


def resume_note(plan: ResumePlan, run: Run) -> str:
    """One line on what the resumed run continues from and what differs from the configured run."""
    info, c = plan.checkpoint, run.counters
    notes = [f"resuming from {info.path} (step {info.step} of {run.max_steps})"]
    if run.max_steps != c.schedule_steps:
        notes.append(
            f"the learning-rate schedule keeps its {c.schedule_steps}-step horizon ({run_length(run)} now)"
        )
    saved_world = info.meta.get("world_size", 1)
    if saved_world != run.dist.world_size:
        notes.append(
            f"written by {saved_world} process(es), continued on {run.dist.world_size}: micro-batch {run.loader.batch_size} "
            f"x accumulation {run.grad_accum} x {run.dist.world_size}, the same global batch"
        )
    elif run.loader.batch_size != run.cfg.train.micro_batch_size:
        notes.append(
            f"micro-batch {run.loader.batch_size} x accumulation {run.grad_accum}, as chosen after running out of memory"
        )
    if info.meta.get("version") != __version__:
        notes.append(f"the checkpoint was written by trainforge {info.meta.get('version')}")
    return "; ".join(notes)
