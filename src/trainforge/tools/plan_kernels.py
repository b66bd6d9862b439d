"""What plan says about the kernels a run would use on the planned hardware: ``train.kernels``
(Liger's Triton kernels) and ``train.fp8`` (torchao's FP8 linear layers)."""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..model.fp8 import fp8_recipe
from ..profiles import FP8_TENSOR_CORES, HardwareProfile


def kernels_choice(cfg: RunConfig, device: torch.device | None, profile: HardwareProfile | None) -> str:
    """What ``train.kernels`` resolves to on the planned hardware (a GPU profile: as it would on that GPU)."""
    from ..model.kernels import liger_installed

    requested = cfg.train.kernels
    if device is not None or profile is None or profile.kind != "gpu":
        return requested if requested != "auto" else "torch"
    if requested != "auto":
        return requested
    here = "installed here" if liger_installed() else "not installed here"
    return f"liger where liger-kernel is installed ({here}; pip install 'trainforge[gpu]'), else torch"


def fp8_decision(cfg: RunConfig) -> dict[str, str] | None:
    """The plan's ``fp8`` row when ``train.fp8`` is on."""
    if not cfg.train.fp8:
        return None
    return {"setting": "fp8", "choice": str(fp8_recipe(cfg.train.fp8)), "why": "train.fp8: the linear layers' matmuls in FP8 "
            "(torchao), traced as they run eagerly: matmuls at the FP8 rate, each scale and cast a kernel of its own "
            "(train.compile fuses them; the plan does not model that)"}


def fp8_uncompiled(cfg: RunConfig) -> tuple[str, str] | None:
    """(message, fix) when ``train.fp8`` runs eagerly: torchao's scales and casts are kernels of their own."""
    if not cfg.train.fp8 or cfg.train.compile is not False:
        return None
    return ("train.fp8 with train.compile: false: torchao's scales and casts run as separate kernels, which can cost "
            "more than the FP8 matmuls save (this plan prices them so)", "set train.compile: true (or auto)")


def fp8_problem(cfg: RunConfig, precision_name: str, profile: HardwareProfile) -> tuple[str, str] | None:
    """(message, fix) when ``train.fp8`` cannot run as planned: no bf16 compute, or a GPU without FP8 tensor cores."""
    if not cfg.train.fp8:
        return None
    if precision_name != "bf16":
        return (f"train.fp8 runs around bf16 compute, and this plan's precision is {precision_name}",
                "set train.precision: bf16 (on hardware with bf16), or train.fp8: false")
    if profile.kind == "gpu" and profile.name not in FP8_TENSOR_CORES:
        return (f"train.fp8: {profile.title} has no FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)",
                "set train.fp8: false")
    return None
