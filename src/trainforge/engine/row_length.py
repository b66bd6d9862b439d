"""The row length at set-up, before the data is tokenized and the model loaded: ``data.max_length: auto`` resolved
(the longest that fits here: predict/longest.py's ``auto_length``; a resumed run takes its checkpoint's), a length
past a learned position table refused (exit 2), and a run that cannot fit refused (exit 4): by a rough estimate far
over the device, or by the traced step with every long-context lever the run may use, naming the longest length
that fits."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config.errors import ConfigError
from ..config.run import RunConfig
from ..dist import DistContext
from ..errors import TrainforgeError
from ..hardware.device import Precision, device_memory, this_profile
from ..hardware.profiles import GIB, HardwareProfile
from ..metrics.console import ConsoleReporter
from ..model.load import check_positions
from ..rundir.checkpoint import STEP_PREFIX, inspect_checkpoint, scan_checkpoints
from .oom import OutOfMemory
from .predict.fit import FIT_MARGIN, QUICK_SHARE, predict_memory, rough_skeleton_estimate
from .predict.levers import tiling_covers, with_levers
from .predict.longest import GRANULE, auto_cap, auto_length, auto_rows, gib, longest_length, run_levers
from .predict.memory import memory_refusal
from .resume import CHECKPOINTS


@dataclass
class LengthDecision:
    """Rank 0's decision, for every rank: the row length and why, or the error that ends the run."""

    length: int
    why: str
    error: TrainforgeError | None = None


def with_length(cfg: RunConfig, length: int) -> RunConfig:
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": length})})


def fit_length(
    cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, ctx: DistContext, out: Path, resume: str,
    reporter: ConsoleReporter,
) -> tuple[RunConfig, dict[str, Any]]:
    """``cfg`` with ``data.max_length`` resolved where it is auto (said on the console), and its facts for summary.json;
    refuses what cannot run before anything is tokenized or loaded. Rank 0 decides (its free memory), the others take
    its answer."""
    auto = cfg.data.max_length == "auto"
    if not auto:  # a row past a learned position table fails mid-step: exit 2 on every rank alike
        check_positions(cfg.model, cfg.data.max_length, reporter.warn)
    decided = None
    if ctx.is_main:
        try:
            decided = decide_length(cfg, tokenizer, precision, device, ctx, out, resume)
        except TrainforgeError as e:  # every rank ends with it (the others wait on the broadcast)
            decided = LengthDecision(0, "", e)
    decided = ctx.broadcast_object(decided)
    if decided.error is not None:
        decided.error.decided_by_rank_zero = True  # one error for all ranks: rank 0 says it (cli.train)
        raise decided.error
    if not auto:
        return cfg, {"max_length": cfg.data.max_length, "max_length_reason": "as configured"}
    reporter.info(f"max_length auto -> {decided.why}")
    cfg = with_length(cfg, decided.length)
    check_positions(cfg.model, decided.length, reporter.warn)  # a checkpoint's length past a rotary model's: said
    return cfg, {"max_length": decided.length, "max_length_reason": decided.why}


def decide_length(
    cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, ctx: DistContext, out: Path, resume: str,
) -> LengthDecision:
    """The row length (``auto``: the checkpoint's where the run resumes one, else ``auto_length``'s on this machine),
    once ``refuse_what_cannot_fit`` passes it."""
    if cfg.data.max_length != "auto":
        refuse_what_cannot_fit(cfg, tokenizer, precision, device, ctx)
        return LengthDecision(cfg.data.max_length, "as configured")
    saved = resumed_length(out, resume)
    if saved is not None:  # the checkpoint's rows, tokenized alike: a resume continues the same data exactly
        refuse_what_cannot_fit(with_length(cfg, saved), tokenizer, precision, device, ctx)
        return LengthDecision(saved, f"{saved}: as in the checkpoint being resumed")
    mode = "fsdp" if ctx.enabled and cfg.train.distributed == "fsdp" else "ddp"
    try:
        profile = this_profile(device, cfg.data.cache_dir, timing=False)
    except ValueError as e:  # a GPU without a hardware profile
        raise ConfigError(f"data.max_length: auto sizes the row by this device's memory: {e}; or give a number") from None
    choice = auto_length(cfg, tokenizer, precision, profile, ctx.world_size, mode)
    if choice.length == 0:  # the shortest row is refused with what does not fit (the model itself)
        refuse_what_cannot_fit(with_length(cfg, min(GRANULE, auto_cap(cfg)[0])), tokenizer, precision, device, ctx)
        raise OutOfMemory(f"data.max_length auto: {choice.why} (predicted by the traced step); refused before loading the "
                          "data and the model. `trainforge plan CONFIG` shows the prediction part by part")
    return LengthDecision(choice.length, choice.why)


def resumed_length(out: Path, resume: str) -> int | None:
    """``data.max_length`` of the checkpoint this run will resume (``--resume auto``: the newest complete one in ``out``;
    a path: the checkpoint there, or the newest of a run directory), from its meta.json; None for a fresh run. A
    checkpoint that turns out not to load is ``choose_checkpoint``'s to report (an older one of the same run has the
    same length)."""
    if resume == "never":
        return None
    path = out / CHECKPOINTS if resume == "auto" else Path(resume)
    if resume != "auto" and (path.name.startswith(STEP_PREFIX) or (path / "meta.json").exists()):
        found = inspect_checkpoint(path)
        infos = [] if isinstance(found, str) else [found]
    else:
        infos = scan_checkpoints(path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path)[0]
    length = infos[-1].meta.get("fixed", {}).get("data.max_length") if infos else None
    return length if isinstance(length, int) and not isinstance(length, bool) else None


def refuse_what_cannot_fit(cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, ctx: DistContext) -> None:
    """Raise ``OutOfMemory`` (exit 4) before anything is allocated when the run cannot fit, even at the least it can
    get to on its own: one row on a single GPU (out of memory backs off to it), else the configured micro-batch (a CPU
    process is killed, data-parallel ranks do not back off); under FSDP the model state shared by the processes.

    First the rough estimate from the model's skeleton on the meta device (memory.py), with activation checkpointing
    when it is on or auto: far below the device, nothing more. Else the traced step with every long-context lever the
    run may use (``run_levers``) decides: over the device's memory, refused, naming the longest ``data.max_length``
    that fits where the length is what does not (``length_refusal``); the rough estimate's refusal (``REFUSE_FACTOR``
    times over) stands alone only where the model's state (weights, gradients, optimizer) alone is over the device,
    or the step cannot be traced."""
    capacity, where = device_memory(device)
    if not capacity:
        return
    t = cfg.train
    backs_off = device.type == "cuda" and not ctx.enabled  # down to one row (grpo: one group of completions)
    rows = auto_rows(cfg if not backs_off else cfg.model_copy(update={"train": t.model_copy(update={"micro_batch_size": "auto"})}))
    ckpt = t.activation_checkpointing is not False
    shards = ctx.world_size if ctx.enabled and t.distributed != "ddp" else 1
    try:
        est = rough_skeleton_estimate(cfg, tokenizer, precision, rows, ckpt, shards)
    except TrainforgeError:
        raise
    except Exception:  # a model the skeleton cannot describe: the run goes on, the warning after loading still speaks
        return
    fixes = _fixes(cfg, rows, ckpt, ctx.enabled and shards == 1)
    rough = memory_refusal(est, capacity, where, "at micro-batch " + str(rows) + (" with activation checkpointing" if ckpt else ""), fixes)
    if est.total < QUICK_SHARE * capacity:
        return
    if rough and est.total - est.activations > capacity:  # the model's state alone: no lever of the row helps
        raise OutOfMemory(rough)
    mode = "fsdp" if ctx.enabled and t.distributed == "fsdp" else "ddp"
    try:
        profile = replace(this_profile(device, cfg.data.cache_dir, timing=False), memory_gib=capacity / GIB)
        fits, message, by_length = length_refusal(cfg, tokenizer, precision, profile, rows, ctx.world_size, mode, where, fixes)
    except TrainforgeError:
        raise
    except Exception:  # a step the tracer cannot follow (or a GPU without a profile): the rough estimate alone
        fits, message, by_length = False, None, False
    if not fits and (message or rough):  # the model itself too big: the rough estimate's parts say more, where it refuses
        raise OutOfMemory(message if by_length or not rough else rough)


def length_refusal(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, rows: int, world_size: int, mode: str,
    where: str, fixes: list[str],
) -> tuple[bool, str | None, bool]:
    """(whether the traced step at ``rows`` rows with the levers the run may use fits the device's memory, why not,
    whether the length is what does not): where a row of ``GRANULE`` tokens would fit, the length, and the message
    names the longest that fits (in ``FIT_MARGIN``, as ``auto`` takes it); else the model itself, saying so."""
    levers = run_levers(cfg, profile)
    memory = predict_memory(with_levers(cfg, levers), tokenizer, precision, profile, rows, levers.checkpointing,
                            cfg.train.grad_accum, world_size, mode)
    if memory.fits():
        return True, None, False
    length = cfg.data.max_length
    at = (f"predicted {gib(memory.process)} at {rows} row{'s' if rows != 1 else ''} of {length:,} tokens with "
          f"{levers.describe()}, over the {gib(profile.memory_bytes)} of {where}")
    shortest = min(GRANULE, length)
    short = predict_memory(with_levers(cfg, levers, shortest), tokenizer, precision, profile, rows, levers.checkpointing,
                           cfg.train.grad_accum, world_size, mode)
    if length <= shortest or not short.fits(FIT_MARGIN):
        return False, (f"this run cannot fit: {at}, and not even {shortest} tokens per row fit; refused before loading "
                       "the data and the model. To fit: " + "; ".join([f for f in fixes if "data.max_length" not in f] or fixes)), False
    found = longest_length(cfg, tokenizer, precision, profile, levers, FIT_MARGIN, world_size, mode, rows)
    return False, (
        f"data.max_length {length:,} does not fit even with the long-context levers: {at}; the longest that fits (in "
        f"{FIT_MARGIN:.0%}) is {found.length:,} tokens: set data.max_length: {found.length} or less (or auto, which takes "
        f"it){_lever_hints(cfg, profile, rows)}. Refused before loading the data and the model; "
        "`trainforge plan CONFIG --longest` shows what each lever buys"
    ), True


def _lever_hints(cfg: RunConfig, profile: HardwareProfile, rows: int) -> str:
    """The levers the config turns off that would act here, and a smaller micro-batch, as further ways to fit."""
    t = cfg.train
    off = [k for k, off in (("activation_checkpointing", t.activation_checkpointing is False),
                            ("tiled_mlp", t.tiled_mlp is False and tiling_covers(cfg)),
                            ("activation_offload", t.activation_offload is False and profile.kind == "gpu"),
                            ("compact_heap", t.compact_heap is False and profile.kind == "cpu")) if off]
    hints = [f"train.{k}: auto (it is off)" for k in off] + (["a smaller train.micro_batch_size"] if rows > 1 else [])
    return "; or a longer row with " + ", ".join(hints) if hints else ""


def _fixes(cfg: RunConfig, rows: int, ckpt: bool, sharding_helps: bool) -> list[str]:
    """What lowers a run's memory, for the refusals: the micro-batch, the length, checkpointing, the model, sharding."""
    fixes = (["lower train.micro_batch_size (raise train.grad_accum to keep the global batch)"] if rows > 1 else []) + [
        f"lower data.max_length ({cfg.data.max_length})"
    ]
    if not ckpt:
        fixes.append("set train.activation_checkpointing: auto")
    if cfg.model.init is not None:
        fixes.append("make model.init smaller (hidden_size, intermediate_size, num_hidden_layers)")
    elif cfg.model.method != "qlora":
        fixes.append("use model.method: " + ("lora or qlora" if cfg.model.method == "full" else "qlora"))
    if sharding_helps:
        fixes.append("use train.distributed: fsdp")
    return fixes


def resolve_here(cfg: RunConfig, reporter: ConsoleReporter | None = None) -> RunConfig:
    """``data.max_length: auto`` resolved on this machine as a run here resolves it, for ``trainforge prepare`` (its
    token cache is keyed by the length; free memory moves the answer a little on a CPU: give the number from
    ``plan --longest`` to share one cache for sure)."""
    if cfg.data.max_length != "auto":
        return cfg
    from ..data.plan import get_tokenizer
    from ..hardware.device import pick_device, resolve_precision

    reporter = reporter or ConsoleReporter()
    device = pick_device(cfg.train.device)
    precision, _ = resolve_precision(cfg.train.precision, device, cfg.data.cache_dir)
    from rich.console import Console

    tokenizer = get_tokenizer(cfg, ConsoleReporter(Console(quiet=True)))  # prepare says it, once, when it loads it again
    decided = decide_length(cfg, tokenizer, precision, device, DistContext(), Path("."), "never")
    reporter.info(f"max_length auto -> {decided.why}")
    return with_length(cfg, decided.length)
