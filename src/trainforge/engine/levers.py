"""The long-context levers in a run: ``train.tiled_mlp`` and ``train.activation_offload`` resolved when auto
(from the plan of this run on this machine: predict/levers.py) and applied to the built model; on a CPU the heap
made compact where the run needs memory (``train.compact_heap``, hardware/heap.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..config.run import RunConfig
from ..hardware.device import Precision
from .offload import BoundaryOffload, install_offload
from .predict.fit import MemoryPrediction

CPU_OFFLOAD_NOTE = ("train.activation_offload: on a CPU the checkpointed layers' inputs already sit in host memory; "
                    "nothing is moved (it acts on a GPU)")


def resolve_run_levers(cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, ctx,
                       say: Callable[[str], None]) -> tuple[RunConfig, MemoryPrediction | None]:
    """``cfg`` with ``tiled_mlp``/``activation_offload: auto`` decided by the plan of this run here (rank 0 decides,
    the others take its answer), each decision said with its reason; and the prediction that decided (its figures,
    not its trace), where one was made."""
    t = cfg.train
    if t.tiled_mlp != "auto" and t.activation_offload != "auto":
        if t.activation_offload is True and t.activation_checkpointing == "auto" and device.type == "cuda":
            say("activation checkpointing auto -> on: train.activation_offload moves its boundaries")
            return cfg.model_copy(update={"train": t.model_copy(update={"activation_checkpointing": True})}), None
        return cfg, None
    from ..hardware.device import this_profile
    from .predict.levers import decide_levers, resolved_config

    choice = None
    if ctx.is_main:
        profile = this_profile(device, cfg.data.cache_dir, timing=False)
        choice = decide_levers(cfg, tokenizer, precision, profile, ctx.world_size, "fsdp" if t.distributed == "fsdp" else "ddp")
        if choice.memory is not None:
            choice.memory = replace(choice.memory, trace=None)  # the figures travel to the other ranks; the trace stays
    choice = ctx.broadcast_object(choice)
    if t.tiled_mlp == "auto":
        say(f"tiled MLP auto -> {choice.why_tiled}")
    if t.activation_offload == "auto":
        say(f"activation offload auto -> {choice.why_offload}")
    return resolved_config(cfg, choice), choice.memory


def apply_levers(model: torch.nn.Module, cfg: RunConfig, device: torch.device, say: Callable[[str], None]) -> torch.nn.Module:
    """Tile the model's MLPs and offload its checkpoint boundaries where ``cfg`` says true (auto: resolved before)."""
    t = cfg.train
    if t.tiled_mlp is True:
        from ..model.tiled_mlp import apply_tiled_mlp, decoder_mlps

        n = apply_tiled_mlp(model)
        say(f"tiled MLP: {n} decoder MLPs run in tiles of {decoder_mlps(model)[0].trainforge_tile_tokens} tokens")
    if t.activation_offload is True:
        if device.type != "cuda":
            say(CPU_OFFLOAD_NOTE)
        elif t.activation_checkpointing is not True:
            say("train.activation_offload: activation checkpointing is off, so there are no boundaries to move")
        else:
            offload = BoundaryOffload(device)
            n = install_offload(model, offload)
            model.trainforge_offload = offload  # what it moved: count and bytes, for the summary
            say(f"activation offload: the inputs of {n} checkpointed layers kept in pinned host memory")
    return model


ROUGH_SHARE_OF_COMPACT = 0.7  # a rough process estimate under 70% of the compact heap's share: traced no further


def heap_memory(cfg: RunConfig, tokenizer, precision: Precision, device: torch.device, ctx,
                fit_memory: MemoryPrediction | None, levers_memory: MemoryPrediction | None) -> MemoryPrediction | None:
    """The prediction of the run's step at its settled settings, whose default-heap share decides ``compact_heap:
    auto`` as ``plan`` decides it from its own prediction at those settings: the fit's; the levers' where they traced
    these settings; else one traced here (rank 0 for all; none where the rough estimate, priced as the default heap's
    process, is far below the share). Only a CPU run with the heap on auto and no lever asks."""
    from ..config.run import resolve_grad_accum

    t = cfg.train
    if fit_memory is not None or device.type != "cpu" or t.compact_heap != "auto" or t.activation_checkpointing is True \
            or t.tiled_mlp is True:
        return fit_memory if fit_memory is not None else levers_memory
    if levers_memory is not None and (levers_memory.micro_batch_size, levers_memory.activation_checkpointing) == \
            (t.micro_batch_size, bool(t.activation_checkpointing)):
        return levers_memory
    memory = None
    if ctx.is_main:
        from ..hardware.device import this_profile
        from ..hardware.heap import COMPACT_SHARE
        from .predict.fit import allocator_overhead, fixed_bytes, predict_memory, rough_skeleton_bytes

        profile = this_profile(device, cfg.data.cache_dir, timing=False)
        rows = t.micro_batch_size
        # the rough estimate priced as the default heap's process: far below the share, no trace needed
        rough = rough_skeleton_bytes(cfg, tokenizer, precision, rows) * (1 + allocator_overhead(profile)) + fixed_bytes(cfg, profile)
        if rough >= ROUGH_SHARE_OF_COMPACT * COMPACT_SHARE * profile.memory_bytes:
            mode = "fsdp" if t.distributed == "fsdp" else "ddp"
            memory = predict_memory(cfg, tokenizer, precision, profile, rows, bool(t.activation_checkpointing),
                                    resolve_grad_accum(t, ctx.world_size), ctx.world_size, mode)
            memory = replace(memory, trace=None)
    return ctx.broadcast_object(memory)


def settle_heap(cfg: RunConfig, device: torch.device, say: Callable[[str], None],
                memory: MemoryPrediction | None = None) -> dict[str, object]:
    """Make this process's heap compact or not as ``train.compact_heap`` says for the run's settled levers and the
    prediction of its step (``memory``, where one was made: its default-heap share decides as in ``plan``), before
    the model is built, so loading gives its freed blocks back too; the choice and why, for summary.json."""
    from ..hardware.heap import apply_compact_heap, compact_heap

    t = cfg.train
    share = memory.heap_share if memory is not None else None
    on, why = compact_heap(t.compact_heap, device.type, t.activation_checkpointing is True, t.tiled_mlp is True,
                           predicted_share=share)
    apply_compact_heap(on)
    if on or t.compact_heap is True:  # an auto that stays off is the common case: not worth a line
        say(f"compact heap {'auto ' if t.compact_heap == 'auto' else ''}-> {why}")
    return {"compact_heap": on, "compact_heap_reason": why}
