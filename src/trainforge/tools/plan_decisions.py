"""What ``trainforge plan`` says the run would decide by itself on a hardware profile, and why: one row per
setting a run resolves (the row length, precision, attention, compile, kernels, checkpointing, micro-batch,
accumulation, the long-context levers, a CPU's heap, FP8, the distributed mode)."""

from __future__ import annotations

import torch

from ..config.run import RunConfig
from ..hardware.device import Precision
from ..hardware.profiles import HardwareProfile
from .plan_kernels import fp8_decision, kernels_choice, planned_attention


def with_auto_length(cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile,
                     world_size: int = 1) -> tuple[RunConfig, list[dict[str, str]]]:
    """``cfg`` with ``data.max_length: auto`` taken as a run on ``profile`` takes it (``auto_length``), and its decision
    row (none where the length is a number); where nothing fits, the shortest row, for the plan to show why."""
    if cfg.data.max_length != "auto":
        return cfg, []
    from ..engine.predict.longest import GRANULE, auto_cap, auto_length

    mode = "fsdp" if world_size > 1 and cfg.train.distributed == "fsdp" else "ddp"
    choice = auto_length(cfg, tokenizer, precision, profile, world_size, mode)
    length = choice.length or min(GRANULE, auto_cap(cfg)[0])
    data = cfg.data.model_copy(update={"max_length": length})
    return cfg.model_copy(update={"data": data}), [{"setting": "max_length", "choice": str(length), "why": choice.why}]


def decisions(
    cfg: RunConfig, precision: Precision, precision_why: str, device: torch.device | None, fit, accum: int,
    world_size: int, mode: str, profile: HardwareProfile | None = None, lever_why: dict[str, str] | None = None,
) -> list[dict[str, str]]:
    """What the run would decide by itself on this hardware, and why (``lever_why``: why each long-context lever
    left to auto took its setting, from ``with_decided_levers``)."""
    attn = planned_attention(cfg, precision, device, profile)
    compile_why = {
        True: "on: as configured",
        False: "off: as configured",
        "auto": "measured: compiled only when the first steps show the compile time pays off over the run "
        "(and never again for a config measured no faster on this machine)",
    }[cfg.train.compile]
    out = [
        {"setting": "precision", "choice": precision.name, "why": precision_why},
        {"setting": "attention", "choice": attn, "why": "model.attention: " + cfg.model.attention},
        {"setting": "compile", "choice": str(cfg.train.compile), "why": compile_why},
        {"setting": "kernels", "choice": kernels_choice(cfg, device, profile), "why": "train.kernels: " + cfg.train.kernels},
        {"setting": "activation_checkpointing", "choice": str(fit.activation_checkpointing).lower(), "why": fit.why_checkpointing},
        {"setting": "micro_batch_size", "choice": str(fit.micro_batch_size), "why": fit.why_micro_batch},
        {
            "setting": "grad_accum", "choice": str(accum),
            "why": f"global batch {fit.micro_batch_size * accum * world_size} rows = micro-batch {fit.micro_batch_size} x "
            f"accumulation {accum} x {world_size} process(es)",
        },
    ]
    for setting in ("tiled_mlp", "activation_offload"):
        why = (lever_why or {}).get(setting) or f"train.{setting}: {getattr(cfg.train, setting)}"
        out.append({"setting": setting, "choice": str(getattr(cfg.train, setting)).lower(), "why": why})
    if profile is not None and profile.kind == "cpu":  # a GPU run's tensors are not on the heap
        from ..hardware.heap import compact_heap

        share = fit.memory.heap_share if fit.memory is not None else None  # the default heap's predicted share
        on, why = compact_heap(cfg.train.compact_heap, "cpu", bool(fit.activation_checkpointing), cfg.train.tiled_mlp is True,
                               predicted_share=share)
        out.append({"setting": "compact_heap", "choice": str(on).lower(), "why": why})
    if fp8_decision(cfg):
        out.append(fp8_decision(cfg))
    if world_size > 1:
        out.append({"setting": "distributed", "choice": mode, "why": "train.distributed: " + cfg.train.distributed})
    return out
